"""DualPath's inter-engine scheduler (PAPERS.md 2.6): a prefill TE, a decode
TE and the side that reads the prompt's cached KV from storage, per request.

    TEReport (load_tokens, num_running + num_waiting, storage_queue_tokens,
              num_free_tokens) ──EngineLoad──> DualPathScheduler.choose(request)
        PE:   C1 tok > beta: never; C2 read queue <= alpha: min tok; else C3: min tok
        DE:   the group with the least total tok (among groups where a DE has room);
              in it, Z = z_factor * (len(r) + sum tok) / |group|: the DEs with room and
              tok + len(r) <= Z, fewest requests first; else the one with least tok
        path: the side whose read queue is shorter (a tie: the side that was given
              less to read so far; then "prefill")
    ──DualPathDecision──> the job executor: decode task (read_path) + prefill TE

Loads are what the TEs last reported plus what was routed to them since
(`assigned`, cleared by their next report), so a burst spreads out before
the reports catch up. `choose` returns None when no PE is under beta or no
DE has room: the request waits (the job executor parks it) rather than
piling onto an engine that is full. Pure Python: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Collection, Iterable, Mapping

from deepserve.messages.control import TEInfo, TEReport

PREFILL_PATH, DECODE_PATH = "prefill", "decode"


@dataclass(frozen=True)
class EngineLoad:
    te_id: str
    tokens: int = 0  # unfinished tokens (tok_e): to compute and to generate
    num_seqs: int = 0  # unfinished requests (seq_e)
    read_queue: int = 0  # tokens waiting to be read from storage (read_q)
    free_tokens: int = 1 << 30  # KV room (a decode engine's HBM)
    group: str = ""  # DE groups (DualPath: the engines of one node); "" = its own


@dataclass(frozen=True)
class DualPathDecision:
    prefill_te: str
    decode_te: str
    read_path: str
    reason: str
    pe_read_queue: int = 0  # what was compared: each side's read queue (tokens) ...
    de_read_queue: int = 0
    pe_reads: int = 0  # ... and, on a tie, the tokens each was given to read so far
    de_reads: int = 0

    def details(self) -> dict:
        """The decision and what it compared (the JE's dualpath_decision event)."""
        return {k: v for k, v in vars(self).items() if k != "reason"}


def engine_loads(tes: Iterable[TEInfo], reports: Mapping[str, TEReport], te_type: str,
                 exclude: Collection[str] = ()) -> list[EngineLoad]:
    """The EngineLoad of every listed TE of te_type (a TE not heard from yet: idle)."""
    out = []
    for te in tes:
        if te.te_type != te_type or te.te_id in exclude:
            continue
        r = reports.get(te.te_id)
        if r is None:
            out.append(EngineLoad(te.te_id))
        else:
            out.append(EngineLoad(te.te_id, r.load_tokens, r.num_waiting + r.num_running,
                                  r.storage_queue_tokens, r.num_free_tokens or 1 << 30))
    return out


class DualPathScheduler:
    """alpha_tokens: a read queue this short counts as short (DualPath: tokens
    readable in 3 s); beta_tokens: a PE with more unfinished tokens is
    overloaded (tokens one engine processes in 5 s); read_paths "prefill":
    never the decode side (the PE-only baseline)."""

    def __init__(self, alpha_tokens: int = 8192, beta_tokens: int = 65536,
                 z_factor: float = 1.05, read_paths: str = "both"):
        if alpha_tokens < 0 or beta_tokens <= 0 or z_factor < 1:
            raise ValueError("alpha_tokens >= 0, beta_tokens > 0 and z_factor >= 1 are needed")
        if read_paths not in ("both", PREFILL_PATH):
            raise ValueError(f"read_paths must be 'both' or 'prefill', got {read_paths!r}")
        self.read_paths = read_paths
        self.alpha, self.beta, self.z_factor = alpha_tokens, beta_tokens, z_factor
        self.assigned: Counter[str] = Counter()  # tokens routed since the TE's report
        self.assigned_reads: Counter[str] = Counter()
        self.assigned_seqs: Counter[str] = Counter()
        self.total_reads: Counter[str] = Counter()  # tokens ever sent to a TE to read

    def on_report(self, te_id: str) -> None:
        """A fresh TEReport: its numbers include what was assigned before it."""
        for counter in (self.assigned, self.assigned_reads, self.assigned_seqs):
            counter.pop(te_id, None)

    def _now(self, e: EngineLoad) -> EngineLoad:
        return EngineLoad(e.te_id, e.tokens + self.assigned[e.te_id],
                          e.num_seqs + self.assigned_seqs[e.te_id],
                          e.read_queue + self.assigned_reads[e.te_id],
                          e.free_tokens - self.assigned[e.te_id], e.group or e.te_id)

    # -- the decision ------------------------------------------------------------------
    def choose(self, prompt_len: int, max_tokens: int, pes: list[EngineLoad],
               des: list[EngineLoad]) -> DualPathDecision | None:
        pe = self.choose_prefill(prompt_len, [self._now(e) for e in pes])
        de = self.choose_decode(prompt_len + max_tokens, [self._now(e) for e in des])
        if pe is None or de is None:
            return None
        pe_reads, de_reads = self.total_reads[pe.te_id], self.total_reads[de.te_id]
        by_queue = (de.read_queue, de_reads) < (pe.read_queue, pe_reads)
        path = DECODE_PATH if by_queue and self.read_paths == "both" else PREFILL_PATH
        reader = de if path == DECODE_PATH else pe
        self.total_reads[reader.te_id] += prompt_len
        self.assigned[pe.te_id] += prompt_len
        self.assigned[de.te_id] += prompt_len + max_tokens
        self.assigned_seqs[de.te_id] += 1
        self.assigned_reads[reader.te_id] += prompt_len
        return DualPathDecision(pe.te_id, de.te_id, path,
                                f"PE {pe.te_id} (tok {pe.tokens}, read_q {pe.read_queue}), "
                                f"DE {de.te_id} (tok {de.tokens}, read_q {de.read_queue}): "
                                f"read on the {path} side",
                                pe.read_queue, de.read_queue, pe_reads, de_reads)

    def choose_prefill(self, prompt_len: int, pes: list[EngineLoad]) -> EngineLoad | None:
        """C2 (short read queue, not overloaded) first, then C3; C1 never."""
        c2 = [e for e in pes if e.tokens <= self.beta and e.read_queue <= self.alpha]
        c3 = [e for e in pes if e.tokens <= self.beta and e.read_queue > self.alpha]
        for klass in (c2, c3):
            if klass:
                return min(klass, key=lambda e: (e.tokens, e.te_id))
        return None

    def choose_decode(self, need: int, des: list[EngineLoad]) -> EngineLoad | None:
        groups: dict[str, list[EngineLoad]] = {}
        for e in des:
            groups.setdefault(e.group, []).append(e)
        roomy = {g: es for g, es in groups.items() if any(e.free_tokens >= need for e in es)}
        if not roomy:
            return None
        group = min(roomy, key=lambda g: (sum(e.tokens for e in roomy[g]), g))
        members = roomy[group]
        z = self.z_factor * (need + sum(e.tokens for e in members)) / len(members)
        fit = [e for e in members if e.free_tokens >= need]
        low = [e for e in fit if e.tokens + need <= z]
        if low:
            return min(low, key=lambda e: (e.num_seqs, e.tokens, e.te_id))
        return min(fit, key=lambda e: (e.tokens, e.te_id))
