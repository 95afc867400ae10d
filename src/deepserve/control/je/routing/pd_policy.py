"""PD-aware choice of the TE type (DeepServe Algorithm 1, step 1; PAPERS.md 1.8).

    prompt ids ─> DecodeLengthPredictor ─> decode bucket k ─> d = 128k + 64
        │                                                      │
        └──── p = len(prompt) ──> Heatmap.lookup(p, d) ─> v ───┴─> PDPolicy
                                                    "colocated" | "disaggregated"
                                      then Router.decide(..., te_type) picks the TE

The heatmap (control/je/routing/pd_heatmap.py) and the decode-length predictor
(control/je/routing/decode_predictor.py) are read from conf/ by PDPolicy.from_files.

PDPolicy modes:
  heatmap        disaggregated when lookup(p, predicted d) > margin (default 0.0);
                 an unmeasured cell falls back to the threshold rule
  threshold      disaggregated when p >= min_prompt_len (1024) and the predicted
                 d <= max_decode_len (128: with midpoints, only bucket 0, i.e.
                 under 128 output tokens); with no predictor, prompt length only
  colocated      always colocated (the default: no PD TEs in the cluster)
  disaggregated  always disaggregated
decide(prompt_ids, te_types) returns a PDDecision (type, rule, reason,
predicted decode length, heatmap value), also kept as `last_decision`; given
the TE list's te_type values, a type with no TEs ("disaggregated" needs prefill
and decode TEs) turns into the other one (rule "fallback").
from_files(): every file named is loaded, used by the mode or not, and one
that is missing or malformed raises PDConfigError (a ValueError) naming it.
A path of None means "no such input": threshold mode then uses the
prompt-length-only rule, heatmap mode refuses (it needs both). Pure Python,
no I/O after loading (a decision is ~50 us).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Sequence

import msgspec.structs

from deepserve.control.je.routing.decode_predictor import DecodeLengthPredictor
from deepserve.control.je.routing.pd_heatmap import Heatmap, PDConfigError

if TYPE_CHECKING:
    from deepserve.config.node import RouterSection

MODES = ("heatmap", "threshold", "colocated", "disaggregated")


# -- the policy ------------------------------------------------------------------------
@dataclass(frozen=True)
class PDDecision:
    """te_type: "colocated" or "disaggregated"; rule: fixed, heatmap, threshold,
    length (prompt-length-only threshold) or fallback (chosen type absent)."""

    te_type: str
    rule: str
    reason: str
    prompt_len: int
    decode_len: int | None = None
    heatmap_value: float | None = None


class PDPolicy:
    def __init__(self, mode: str = "colocated", heatmap: Heatmap | None = None,
                 predictor: DecodeLengthPredictor | None = None, *, margin: float = 0.0,
                 min_prompt_len: int = 1024, max_decode_len: int = 128):
        if mode not in MODES:
            raise PDConfigError(f"PD policy mode must be one of {MODES}, got {mode!r}")
        if mode == "heatmap" and (heatmap is None or predictor is None):
            raise PDConfigError("PD policy mode 'heatmap' needs a heatmap and a decode predictor")
        self.mode, self.heatmap, self.predictor = mode, heatmap, predictor
        self.margin = float(margin)
        self.min_prompt_len, self.max_decode_len = int(min_prompt_len), int(max_decode_len)
        self.last_decision: PDDecision | None = None

    @classmethod
    def from_files(cls, mode: str, heatmap_path: str | Path | None = None,
                   predictor_path: str | Path | None = None, **thresholds) -> "PDPolicy":
        """Loads each file given (a missing one is a PDConfigError naming it);
        thresholds: margin, min_prompt_len, max_decode_len."""
        if mode not in MODES:
            raise PDConfigError(f"PD policy mode must be one of {MODES}, got {mode!r}")
        unknown = sorted(set(thresholds) - {"margin", "min_prompt_len", "max_decode_len"})
        if unknown:
            raise PDConfigError(f"unknown PD policy option(s) {unknown}")
        heatmap = Heatmap.load(heatmap_path) if heatmap_path is not None else None
        predictor = (DecodeLengthPredictor.load(predictor_path)
                     if predictor_path is not None else None)
        return cls(mode, heatmap, predictor, **thresholds)

    def choose(self, prompt_ids: Sequence[int], te_types: Collection[str] | None = None,
               max_tokens: int | None = None) -> str:
        return self.decide(prompt_ids, te_types, max_tokens).te_type

    def decide(self, prompt_ids: Sequence[int], te_types: Collection[str] | None = None,
               max_tokens: int | None = None) -> PDDecision:
        """te_types: the TEInfo.te_type values in the TE list, if known; a choice
        whose TEs are absent ("disaggregated" needs prefill and decode TEs)
        turns into the other type when that one is present."""
        p = len(prompt_ids)
        if self.mode in ("colocated", "disaggregated"):
            d = PDDecision(self.mode, "fixed", f"mode {self.mode}", p)
        elif self.mode == "heatmap":
            d = self._by_heatmap(prompt_ids, max_tokens)
        else:
            d = self._by_threshold(prompt_ids, self._predict(prompt_ids, max_tokens), "")
        if te_types is not None:
            d = self._available(d, te_types)
        self.last_decision = d
        return d

    def _predict(self, prompt_ids: Sequence[int], max_tokens: int | None) -> int | None:
        """The predicted decode length, never past the request's own bound."""
        if self.predictor is None:
            return None
        predicted = self.predictor.predict_length(prompt_ids)
        return predicted if max_tokens is None else min(predicted, max_tokens)

    def _by_heatmap(self, prompt_ids: Sequence[int], max_tokens: int | None) -> PDDecision:
        p, dl = len(prompt_ids), self._predict(prompt_ids, max_tokens)
        value = self.heatmap.lookup(p, dl)
        if value is None:
            return self._by_threshold(prompt_ids, dl, "heatmap cell unmeasured; ")
        te_type = "disaggregated" if value > self.margin else "colocated"
        cmp = ">" if value > self.margin else "<="
        return PDDecision(te_type, "heatmap", f"p={p} predicted d={dl}: heatmap {value:+.2f} "
                          f"{cmp} margin {self.margin:+.2f}", p, dl, value)

    def _by_threshold(self, prompt_ids: Sequence[int], dl: int | None, why: str) -> PDDecision:
        p = len(prompt_ids)
        long_prompt = p >= self.min_prompt_len
        if dl is None:
            te_type = "disaggregated" if long_prompt else "colocated"
            return PDDecision(te_type, "length", f"{why}p={p} {'>=' if long_prompt else '<'} "
                              f"{self.min_prompt_len} (no predictor)", p)
        short_decode = dl <= self.max_decode_len
        te_type = "disaggregated" if long_prompt and short_decode else "colocated"
        return PDDecision(te_type, "threshold",
                          f"{why}p={p} {'>=' if long_prompt else '<'} {self.min_prompt_len}, "
                          f"predicted d={dl} {'<=' if short_decode else '>'} "
                          f"{self.max_decode_len}", p, dl)

    @staticmethod
    def _available(d: PDDecision, te_types: Collection[str]) -> PDDecision:
        has = {"colocated": "colocated" in te_types,
               "disaggregated": "prefill" in te_types and "decode" in te_types}
        other = "colocated" if d.te_type == "disaggregated" else "disaggregated"
        if has[d.te_type] or not has[other]:
            return d
        return PDDecision(other, "fallback", f"no {d.te_type} TEs; {d.rule} said: {d.reason}",
                          d.prompt_len, d.decode_len, d.heatmap_value)


def pd_policy_of(r: RouterSection) -> PDPolicy | None:
    """[router]'s PD policy, its files read; None: none set (the job executor
    then goes colocated while a colocated TE exists, else disaggregated)."""
    if r.pd_policy is None:
        return None
    return PDPolicy.from_files(r.pd_policy, r.pd_heatmap, r.pd_predictor,
                               **msgspec.structs.asdict(r.pd_options))
