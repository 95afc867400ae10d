"""Routing of one task among the TEs of one type (DeepServe Algorithm 1, step 2).

    TEList ──update_tes──> Router: TEs by id, their loads   ──route(prompt)──> te_id
    TEReport ──on_report──>   │ load_tokens, inserted/evicted block hashes
                              ▼
                    GlobalPromptIndex (prompt_index.py): per TE, the block hashes it holds

Policies:
  round_robin  cycle over the TEs of the type, in TE-list order
  load         least loaded TE (ties: round robin among the tied)
  locality     longest cached prefix (ties: least loaded, then round robin)
  combined     DeepServe: locality while the loads are balanced, else load

Balanced (combined): with L the loads of the candidate TEs,

    max(L) - min(L) <= max(balance_threshold, balance_ratio * max(L))

balance_threshold is in tokens (absolute), balance_ratio a fraction of the
largest load (relative); the edge counts as balanced. Both are configurable;
balance_ratio = 0 makes the rule purely absolute. The default tolerates
about one long prompt's worth of imbalance, which is what one prefix hit saves.

A TE's load is the `load_tokens` of its latest TEReport (tokens waiting +
running) plus the prompt tokens of everything routed to it since then: route()
adds them optimistically, the next report replaces the sum. Pure Python, no I/O.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Collection, Sequence

from deepserve.cache.block_hash import prompt_block_hashes
from deepserve.control.prompt_index import GlobalPromptIndex
from deepserve.messages.control import TEInfo, TEReport

log = logging.getLogger(__name__)

POLICIES = ("round_robin", "load", "locality", "combined")


class NoTEAvailable(RuntimeError):
    """No TE of the requested type is in the TE list."""


@dataclass(frozen=True)
class RouteDecision:
    """Why a TE was chosen: rule is round_robin, load or locality."""

    te_id: str
    rule: str
    reason: str
    matched_blocks: int = 0


class Router:
    """Chooses a TE per task; fed by the cluster manager's TEList / TEReport.

    balance_threshold (tokens) and balance_ratio: see "Balanced" in the module doc.
    block_size: the platform's default KV block size. Each TE is matched at
    the block size its TEInfo names, since the hashes of different block
    sizes never compare.
    """

    def __init__(self, policy: str = "combined", balance_threshold: float = 2048.0,
                 block_size: int = 16, *, balance_ratio: float = 0.25,
                 index: GlobalPromptIndex | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if balance_threshold < 0 or balance_ratio < 0:
            raise ValueError("balance_threshold and balance_ratio must be >= 0, got "
                             f"{balance_threshold} and {balance_ratio}")
        self.policy = policy
        self.balance_threshold = float(balance_threshold)
        self.balance_ratio = float(balance_ratio)
        self.block_size = block_size
        self.index = index if index is not None else GlobalPromptIndex()
        self.tes: dict[str, TEInfo] = {}  # TE-list order
        self.loads: dict[str, int] = {}
        self.reports: dict[str, TEReport] = {}
        self.num_finished: Counter[str] = Counter()
        self.last_decision: RouteDecision | None = None
        self._rr = 0

    # -- cluster state ------------------------------------------------------------
    def update_tes(self, tes: Sequence[TEInfo]) -> list[str]:
        """Adopt a TE list; returns the ids of TEs that left it."""
        live = {te.te_id: te for te in tes}
        gone = [te_id for te_id in self.tes if te_id not in live]
        for te_id in gone:
            self.index.remove_te(te_id)
            self.loads.pop(te_id, None)
            self.reports.pop(te_id, None)
            self.num_finished.pop(te_id, None)
        for te_id, te in live.items():
            old = self.tes.get(te_id)
            if old is not None and old.block_size != te.block_size:
                self.index.remove_te(te_id)  # its hashes no longer compare
            self.index.add_te(te_id)
            self.loads.setdefault(te_id, 0)
        self.tes = live
        return gone

    def on_report(self, report: TEReport) -> None:
        if report.te_id not in self.tes:
            return  # overtook the TE list, or a late report of a removed TE
        self.reports[report.te_id] = report
        self.loads[report.te_id] = report.load_tokens
        self.index.apply(report.te_id, report.inserted, report.evicted)
        self.num_finished[report.te_id] += len(report.finished)

    # -- routing ---------------------------------------------------------------------
    def route(self, prompt_token_ids: Sequence[int], salt: str | None = None,
              te_type: str = "colocated", exclude: Collection[str] = ()) -> str:
        return self.decide(prompt_token_ids, salt, te_type, exclude).te_id

    def decide(self, prompt_token_ids: Sequence[int], salt: str | None = None,
               te_type: str = "colocated", exclude: Collection[str] = ()) -> RouteDecision:
        """exclude: TE ids not to choose (the JE's isolation of suspects)."""
        candidates = [t for t in self.tes.values()
                      if t.te_type == te_type and t.te_id not in exclude]
        if not candidates:
            raise NoTEAvailable(f"no {te_type} TE in the TE list "
                                f"({len(self.tes)} TE(s) of other types or excluded)")
        hashes = _HashCache(prompt_token_ids, salt)
        if self.policy == "round_robin":
            decision = RouteDecision(self._round_robin(candidates).te_id, "round_robin",
                                     f"round robin over {len(candidates)}")
        elif self.policy == "load":
            decision = self._by_load(candidates, "least loaded")
        elif self.policy == "locality":
            decision = self._by_locality(candidates, hashes, "locality")
        else:
            decision = self._combined(candidates, hashes)
        chosen = self.tes[decision.te_id]
        self.loads[chosen.te_id] += len(prompt_token_ids)
        self.index.note_routed(chosen.te_id, hashes.get(chosen.block_size))
        self.last_decision = decision
        log.debug("route -> %s (%s: %s)", decision.te_id, decision.rule, decision.reason)
        return decision

    def balance_limit(self, loads: Sequence[int]) -> float:
        """Largest load spread that still counts as balanced (see the module doc)."""
        return max(self.balance_threshold, self.balance_ratio * max(loads))

    def is_balanced(self, loads: Sequence[int]) -> bool:
        return max(loads) - min(loads) <= self.balance_limit(loads)

    def _combined(self, candidates: list[TEInfo], hashes: "_HashCache") -> RouteDecision:
        loads = [self.loads[t.te_id] for t in candidates]
        spread, limit = max(loads) - min(loads), self.balance_limit(loads)
        if spread <= limit:
            return self._by_locality(candidates, hashes, f"balanced (spread {spread} <= {limit:g})")
        return self._by_load(candidates, f"imbalanced (spread {spread} > {limit:g})")

    def _by_load(self, candidates: list[TEInfo], why: str) -> RouteDecision:
        least = min(self.loads[t.te_id] for t in candidates)
        te = self._round_robin([t for t in candidates if self.loads[t.te_id] == least])
        return RouteDecision(te.te_id, "load", f"{why}: least load {least}")

    def _by_locality(self, candidates: list[TEInfo], hashes: "_HashCache",
                     why: str) -> RouteDecision:
        matched = {t.te_id: self.index.match(t.te_id, hashes.get(t.block_size))
                   for t in candidates}
        best = max(matched.values())
        tied = [t for t in candidates if matched[t.te_id] == best]
        least = min(self.loads[t.te_id] for t in tied)
        te = self._round_robin([t for t in tied if self.loads[t.te_id] == least])
        return RouteDecision(te.te_id, "locality",
                             f"{why}: {best} cached block(s), {len(tied)} TE(s) tied, load {least}",
                             matched_blocks=best)

    def _round_robin(self, candidates: list[TEInfo]) -> TEInfo:
        te = candidates[self._rr % len(candidates)]
        self._rr += 1
        return te


class _HashCache:
    """The prompt's block hashes, computed once per block size."""

    def __init__(self, token_ids: Sequence[int], salt: str | None):
        self.token_ids, self.salt = token_ids, salt
        self._by_size: dict[int, list[int]] = {}

    def get(self, block_size: int) -> list[int]:
        if block_size not in self._by_size:
            self._by_size[block_size] = prompt_block_hashes(self.token_ids, block_size, self.salt)
        return self._by_size[block_size]
