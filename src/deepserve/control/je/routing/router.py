"""Routing of one task among the TEs of its model and type (DeepServe
Algorithm 1, step 2).

    TEList ──update_tes──> Router: TEs by id and by (model, type), loads ──decide──> te_id
    TEReport ──on_report──>   │ load_tokens, inserted/evicted block hashes
                              ▼
                    GlobalPromptIndex (prompt_index.py): per TE, the block hashes it holds,
                    and per hash the TEs holding it

Policies:
  round_robin  the least recently chosen TE of the type (those never chosen
               first, in the order the TE list first named them): plain round
               robin over one set of TEs, and fair when the decisions of
               several types and models interleave
  load         least loaded TE (ties: the least recently chosen among the tied)
  locality     longest cached prefix (ties: least loaded, then least recently chosen)
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

Cost per decision: O(candidates) in C-level scans (loads, ties) plus the
index walk, O(blocks x TEs holding the prefix); the candidates are the TEs of
the job's model and type, indexed once per changed TE list.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Collection, Sequence

from deepserve.cache.block_hash import prompt_block_hashes
from deepserve.control.je.routing.prompt_index import GlobalPromptIndex
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

    _NEVER = -(1 << 62)  # "last chosen" of a TE not chosen yet: below every real one

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
        self._listed: list[TEInfo] = []  # the list adopted last: an equal one is skipped
        # model (None: any model) -> te_type -> TEs, in the order first listed
        self._pools: dict[str | None, dict[str, dict[str, TEInfo]]] = {}
        self._block_sizes: Counter[int] = Counter()  # of the listed TEs
        self._last_chosen: dict[str, int] = {}  # TE -> number of its latest decision
        self._num_chosen = self._num_listed = 0

    # -- cluster state ------------------------------------------------------------
    def update_tes(self, tes: Sequence[TEInfo]) -> list[str]:
        """Adopt a TE list; returns the ids of TEs that left it. An unchanged
        list (the CM re-publishes it every second) costs one comparison; a
        changed one touches only the TEs that joined, changed or left."""
        tes = list(tes)
        if tes == self._listed:
            return []
        live = {te.te_id: te for te in tes}
        gone = [te_id for te_id in self.tes if te_id not in live]
        for te_id in gone:
            self._forget(self.tes[te_id])
        for te_id, te in live.items():
            old = self.tes.get(te_id)
            if old is not te and old != te:
                self._adopt(te, old)
        self.tes, self._listed = live, tes
        return gone

    def on_report(self, report: TEReport) -> None:
        if report.te_id not in self.tes:
            return  # overtook the TE list, or a late report of a removed TE
        self.reports[report.te_id] = report
        self.loads[report.te_id] = report.load_tokens
        self.index.apply(report.te_id, report.inserted, report.evicted)
        self.num_finished[report.te_id] += len(report.finished)

    def candidates(self, te_type: str, model: str | None = None,
                   exclude: Collection[str] = ()) -> list[TEInfo]:
        """The listed TEs of te_type (and of `model`; None: any), in the order
        the TE list first named them, less those in exclude."""
        pool = self._pools.get(model, {}).get(te_type, {})
        return [te for te_id, te in pool.items() if te_id not in exclude]

    def te_types(self, model: str | None = None, exclude: Collection[str] = ()) -> set[str]:
        """The types of the listed TEs of `model` (None: any) outside exclude."""
        pools = self._pools.get(model, {})
        return {t for t, pool in pools.items()
                if not exclude or any(te_id not in exclude for te_id in pool)}

    def _adopt(self, te: TEInfo, old: TEInfo | None) -> None:
        """A TE joined the list, or its TEInfo changed."""
        if old is not None:
            if (old.model, old.te_type) != (te.model, te.te_type):
                self._unpool(old)
            if old.block_size != te.block_size:
                self.index.remove_te(te.te_id)  # its hashes no longer compare
            self._block_sizes -= Counter([old.block_size])
        self.index.add_te(te.te_id)
        self.loads.setdefault(te.te_id, 0)
        if te.te_id not in self._last_chosen:  # never chosen: in the order first listed
            self._last_chosen[te.te_id] = self._NEVER + self._num_listed
            self._num_listed += 1
        self._block_sizes[te.block_size] += 1
        for model in (te.model, None):
            self._pools.setdefault(model, {}).setdefault(te.te_type, {})[te.te_id] = te

    def _forget(self, te: TEInfo) -> None:
        """A TE left the list."""
        self.index.remove_te(te.te_id)
        for state in (self.loads, self.reports, self.num_finished, self._last_chosen):
            state.pop(te.te_id, None)
        self._block_sizes -= Counter([te.block_size])
        self._unpool(te)

    def _unpool(self, te: TEInfo) -> None:
        for model in (te.model, None):
            types = self._pools[model]
            del types[te.te_type][te.te_id]
            if not types[te.te_type]:
                del types[te.te_type]
            if not types:
                del self._pools[model]

    # -- routing ---------------------------------------------------------------------
    def route(self, prompt_token_ids: Sequence[int], salt: str | None = None,
              te_type: str = "colocated", exclude: Collection[str] = (),
              model: str | None = None, hashes: PromptHashes | None = None) -> str:
        return self.decide(prompt_token_ids, salt, te_type, exclude, model, hashes).te_id

    def decide(self, prompt_token_ids: Sequence[int], salt: str | None = None,
               te_type: str = "colocated", exclude: Collection[str] = (),
               model: str | None = None, hashes: PromptHashes | None = None) -> RouteDecision:
        """model: choose among its TEs (None: any model's, as on a one-model
        node); exclude: TE ids not to choose (the JE's isolation of suspects,
        a small set); hashes: the prompt's PromptHashes (of these ids and
        salt), so that a PD job's two decisions hash it once."""
        pool = self._pools.get(model, {}).get(te_type, {})
        ids = [i for i in pool if i not in exclude] if exclude else list(pool)
        if not ids:
            of = f" of model {model!r}" if model is not None else ""
            raise NoTEAvailable(f"no {te_type} TE{of} in the TE list ({len(self.tes)} TE(s) "
                                f"of other types or models, or excluded)")
        if hashes is None:
            hashes = PromptHashes(prompt_token_ids, salt)
        decision = self._choose(ids, hashes)
        te_id = decision.te_id
        self.loads[te_id] += len(prompt_token_ids)
        self.index.note_routed(te_id, hashes.get(self.tes[te_id].block_size))
        self._last_chosen[te_id] = self._num_chosen
        self._num_chosen += 1
        self.last_decision = decision
        log.debug("route -> %s (%s: %s)", te_id, decision.rule, decision.reason)
        return decision

    def balance_limit(self, loads: Sequence[int]) -> float:
        """Largest load spread that still counts as balanced (see the module doc)."""
        return max(self.balance_threshold, self.balance_ratio * max(loads))

    def is_balanced(self, loads: Sequence[int]) -> bool:
        return max(loads) - min(loads) <= self.balance_limit(loads)

    def _choose(self, ids: list[str], hashes: PromptHashes) -> RouteDecision:
        if self.policy == "round_robin":
            return RouteDecision(self._least_recent(ids), "round_robin",
                                 f"round robin over {len(ids)}")
        loads = list(map(self.loads.__getitem__, ids))
        if self.policy == "load":
            return self._by_load(ids, loads, "least loaded")
        if self.policy == "locality":
            return self._by_locality(ids, loads, hashes, "locality")
        spread, limit = max(loads) - min(loads), self.balance_limit(loads)
        if spread <= limit:
            return self._by_locality(ids, loads, hashes,
                                     f"balanced (spread {spread} <= {limit:g})")
        return self._by_load(ids, loads, f"imbalanced (spread {spread} > {limit:g})")

    def _by_load(self, ids: list[str], loads: list[int], why: str) -> RouteDecision:
        te_id, least = self._least_loaded(ids, loads)
        return RouteDecision(te_id, "load", f"{why}: least load {least}")

    def _by_locality(self, ids: list[str], loads: list[int], hashes: PromptHashes,
                     why: str) -> RouteDecision:
        best, tied = self._best_matches(ids, hashes)
        if best:
            ids = list(tied)
            loads = list(map(self.loads.__getitem__, ids))
        te_id, least = self._least_loaded(ids, loads)
        return RouteDecision(te_id, "locality",
                             f"{why}: {best} cached block(s), {len(ids)} TE(s) tied, load {least}",
                             matched_blocks=best)

    def _best_matches(self, ids: list[str], hashes: PromptHashes) -> tuple[int, set[str]]:
        """The index's best_matches, per block size when the TEs' differ."""
        if len(self._block_sizes) == 1:
            return self.index.best_matches(ids, hashes.get(next(iter(self._block_sizes))))
        groups: dict[int, list[str]] = {}
        for te_id in ids:
            groups.setdefault(self.tes[te_id].block_size, []).append(te_id)
        found = [self.index.best_matches(g, hashes.get(size)) for size, g in groups.items()]
        best = max(n for n, _ in found)
        return best, set().union(*(tied for n, tied in found if n == best))

    def _least_loaded(self, ids: list[str], loads: list[int]) -> tuple[str, int]:
        """(the least recently chosen of the least loaded, its load)."""
        least = min(loads)
        tied = compress(ids, map(operator.eq, loads, repeat(least)))  # all in C: O(ids)
        return self._least_recent(list(tied)), least

    def _least_recent(self, ids: list[str]) -> str:
        return min(ids, key=self._last_chosen.__getitem__)


class PromptHashes:
    """A prompt's block hashes, computed once per block size (the JE makes
    one per job, shared by a PD job's prefill and decode decisions)."""

    def __init__(self, token_ids: Sequence[int], salt: str | None = None):
        self.token_ids, self.salt = token_ids, salt
        self._by_size: dict[int, list[int]] = {}

    def get(self, block_size: int) -> list[int]:
        if block_size not in self._by_size:
            self._by_size[block_size] = prompt_block_hashes(self.token_ids, block_size, self.salt)
        return self._by_size[block_size]
