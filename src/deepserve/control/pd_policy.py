"""PD-aware choice of the TE type (DeepServe Algorithm 1, step 1; PAPERS.md 1.8).

    prompt ids ─> DecodeLengthPredictor ─> decode bucket k ─> d = 128k + 64
        │                                                      │
        └──── p = len(prompt) ──> Heatmap.lookup(p, d) ─> v ───┴─> PDPolicy
                                                    "colocated" | "disaggregated"
                                      then Router.decide(..., te_type) picks the TE

Heatmap file (JSON, conf/pd_heatmap.json):

    {"format": "deepserve.pd_heatmap/1",
     "model": "tiny", "source": "profiled" | "placeholder" | ..., "rates": [0.5, 1.0],
     "created": "2025-01-01T00:00:00Z", "notes": "free text (optional)",
     "prompt_len_edges": [0, 256, 512, ...],      # tokens, strictly increasing
     "ratio_edges": [0, 0.0625, 0.125, ...],      # decode_len / prompt_len, increasing
     "values": [[0.12, null, ...], ...]}          # rows: prompt bins, cols: ratio bins

N+1 edges make N bins [e_i, e_i+1). A cell is JCT(colocated) / JCT(disaggregated)
- 1: positive means disaggregated is faster. null marks an unmeasured cell.
"rates" lists the request rates whose maps were summed into this one (the
paper combines per-RPS maps by element-wise addition: Heatmap.combine). Other
top-level keys are errors (typos must not pass silently); "format" may be
omitted, the metadata keys default to empty. save() writes one grid row a line.

lookup(prompt_len, decode_len) clamps: a prompt shorter than the first edge
uses the first row, one at or past the last edge the last row; the same for
the ratio. An unmeasured (null) cell returns None (no nearest-cell guess);
PDPolicy then applies the threshold rule and says so in its reason.

Decode-length predictor: multinomial logistic regression over 128-token
buckets (bucket k = [128k, 128(k+1)), the top one open-ended). Features, all
from the prompt ids alone (featurize()):
  dense   bias, l = log2(1 + n) / 13, l^2, one-hot of floor(log2(1 + n)) in 0..15
  hashed  num_hash (256) buckets of the last `window` (64) token ids, each id
          hashed by a 32-bit integer mix, term frequency (count / ids in the window)
Training (numpy, imported lazily) is seeded mini-batch Adam with L2; inference
is pure Python over the ~80 non-zero features. predict_length() returns the
bucket midpoint 128k + 64 (the top bucket too).

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

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Sequence

from deepserve.errors import DeepServeError

MODES = ("heatmap", "threshold", "colocated", "disaggregated")
HEATMAP_FORMAT = "deepserve.pd_heatmap/1"
PREDICTOR_FORMAT = "deepserve.decode_predictor/1"
BUCKET_SIZE = 128
_NUM_LEN_BANDS = 16


class PDConfigError(DeepServeError, ValueError):
    """Bad PD policy configuration: unknown mode, missing or malformed file."""


def _read_json(path: str | Path, what: str) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PDConfigError(f"{what} file {str(path)!r} does not exist") from None
    except (OSError, ValueError) as e:
        raise PDConfigError(f"{what} file {str(path)!r} cannot be read: {e}") from e
    if not isinstance(data, dict):
        raise PDConfigError(f"{what} file {str(path)!r} must hold a JSON object")
    return data


def _bin(edges: Sequence[float], x: float) -> int:
    """Index i with edges[i] <= x < edges[i+1], clamped to [0, len(edges) - 2]."""
    i = 0
    while i + 2 < len(edges) and x >= edges[i + 1]:
        i += 1
    return i


# -- heatmap ------------------------------------------------------------------------
@dataclass
class Heatmap:
    prompt_len_edges: list[float]
    ratio_edges: list[float]
    values: list[list[float | None]]
    model: str = ""
    source: str = ""
    rates: list[float] = field(default_factory=list)
    created: str = ""
    notes: str = ""

    def __post_init__(self):
        for name in ("prompt_len_edges", "ratio_edges"):
            edges = getattr(self, name)
            if (not isinstance(edges, list) or len(edges) < 2
                    or not all(isinstance(e, (int, float)) and math.isfinite(e) for e in edges)
                    or any(a >= b for a, b in zip(edges, edges[1:]))):
                raise PDConfigError(f"heatmap {name} must be >= 2 strictly increasing numbers, "
                                    f"got {edges!r}")
        rows, cols = len(self.prompt_len_edges) - 1, len(self.ratio_edges) - 1
        if not isinstance(self.values, list) or len(self.values) != rows or any(
                not isinstance(r, list) or len(r) != cols for r in self.values):
            raise PDConfigError(f"heatmap values must be {rows} rows (prompt bins) of {cols} "
                                "values (ratio bins)")
        for row in self.values:
            for v in row:
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                      or not math.isfinite(v)):
                    raise PDConfigError(f"heatmap cell must be a finite number or null, got {v!r}")

    @classmethod
    def load(cls, path: str | Path) -> "Heatmap":
        data = _read_json(path, "heatmap")
        if data.pop("format", HEATMAP_FORMAT) != HEATMAP_FORMAT:
            raise PDConfigError(f"heatmap file {str(path)!r}: format must be {HEATMAP_FORMAT!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        missing = sorted({"prompt_len_edges", "ratio_edges", "values"} - set(data))
        if unknown or missing:
            raise PDConfigError(f"heatmap file {str(path)!r}: unknown keys {unknown}, "
                                f"missing keys {missing}")
        try:
            return cls(**data)
        except PDConfigError as e:
            raise PDConfigError(f"heatmap file {str(path)!r}: {e}") from None

    def to_json(self) -> dict:
        return {"format": HEATMAP_FORMAT, "model": self.model, "source": self.source,
                "rates": self.rates, "created": self.created, "notes": self.notes,
                "prompt_len_edges": self.prompt_len_edges, "ratio_edges": self.ratio_edges,
                "values": self.values}

    def save(self, path: str | Path) -> None:
        """One key per line, one grid row per line: readable and diffable."""
        data = self.to_json()
        rows = ",\n  ".join(json.dumps(row) for row in data.pop("values"))
        head = "".join(f" {json.dumps(k)}: {json.dumps(v)},\n" for k, v in data.items())
        Path(path).write_text(f"{{\n{head} \"values\": [\n  {rows}\n ]\n}}\n", encoding="utf-8")

    def lookup(self, prompt_len: int, decode_len: int) -> float | None:
        """The cell of (prompt_len, decode_len / prompt_len), clamped; None if unmeasured."""
        row = _bin(self.prompt_len_edges, prompt_len)
        col = _bin(self.ratio_edges, decode_len / max(prompt_len, 1))
        return self.values[row][col]

    @classmethod
    def combine(cls, maps: Sequence["Heatmap"]) -> "Heatmap":
        """Element-wise sum over per-RPS maps of the same grid (measured cells
        only; null where no map measured the cell); rates are concatenated."""
        if not maps:
            raise PDConfigError("combine needs at least one heatmap")
        first = maps[0]
        if any(m.prompt_len_edges != first.prompt_len_edges
               or m.ratio_edges != first.ratio_edges for m in maps):
            raise PDConfigError("combine needs heatmaps with identical edges")
        values = []
        for r in range(len(first.values)):
            row = []
            for c in range(len(first.values[r])):
                cells = [m.values[r][c] for m in maps if m.values[r][c] is not None]
                row.append(sum(cells) if cells else None)
            values.append(row)
        return cls(list(first.prompt_len_edges), list(first.ratio_edges), values,
                   model=first.model, source=first.source,
                   rates=[rate for m in maps for rate in m.rates], created=first.created)

    def to_grid_text(self) -> str:
        """The grid for a person: rows prompt bins, columns d/p ratio bins."""
        def label(lo: float, hi: float) -> str:
            return "-".join(f"{e:.0f}" if e == int(e) else f"{e:.3g}" for e in (lo, hi))
        cols = [label(a, b) for a, b in zip(self.ratio_edges, self.ratio_edges[1:])]
        rows = [label(a, b) for a, b in zip(self.prompt_len_edges, self.prompt_len_edges[1:])]
        width = max(6, *(len(c) for c in cols))
        head = max(len("prompt\\d/p"), *(len(r) for r in rows))
        lines = [f"PD heatmap ({self.source or 'unknown source'}, model {self.model or '?'}, "
                 f"rates {self.rates}): JCT(colocated)/JCT(disaggregated) - 1, "
                 "+ = disaggregated faster, . = unmeasured",
                 "prompt\\d/p".ljust(head) + " " + " ".join(c.rjust(width) for c in cols)]
        for name, row in zip(rows, self.values):
            cells = ("." if v is None else f"{v:+.2f}" for v in row)
            lines.append(name.ljust(head) + " " + " ".join(c.rjust(width) for c in cells))
        return "\n".join(lines)


# -- decode-length predictor ---------------------------------------------------------
def _mix32(x: int) -> int:
    x = (x * 0x9E3779B1) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    return x ^ (x >> 13)


def featurize(prompt_ids: Sequence[int], num_hash: int = 256,
              window: int = 64) -> dict[int, float]:
    """Sparse features {index: value} of a prompt (see the module doc)."""
    n = len(prompt_ids)
    log_len = math.log2(1 + n)
    scaled = log_len / 13.0
    feats = {0: 1.0, 1: scaled, 2: scaled * scaled, 3 + min(int(log_len), _NUM_LEN_BANDS - 1): 1.0}
    tail = prompt_ids[-window:] if window > 0 else ()
    if tail:
        base, w = 3 + _NUM_LEN_BANDS, 1.0 / len(tail)
        for t in tail:
            i = base + _mix32(int(t)) % num_hash
            feats[i] = feats.get(i, 0.0) + w
    return feats


def bucket_of(length: int, num_buckets: int) -> int:
    return min(max(int(length), 0) // BUCKET_SIZE, num_buckets - 1)


class DecodeLengthPredictor:
    """Predicts the 128-token output-length bucket of a prompt. weights: one
    row per bucket, one column per feature (3 + 16 + num_hash)."""

    def __init__(self, weights: list[list[float]], num_hash: int = 256, window: int = 64,
                 metadata: dict | None = None):
        self.num_hash, self.window = int(num_hash), int(window)
        dim = 3 + _NUM_LEN_BANDS + self.num_hash
        if (self.num_hash < 1 or self.window < 0 or len(weights) < 2
                or any(len(row) != dim for row in weights)):
            raise PDConfigError(f"predictor needs >= 2 weight rows of {dim} values "
                                f"(num_hash {num_hash}, window {window})")
        self.weights = [[float(w) for w in row] for row in weights]
        self.metadata = dict(metadata or {})

    @property
    def num_buckets(self) -> int:
        return len(self.weights)

    @classmethod
    def train(cls, pairs: Sequence[tuple[Sequence[int], int]], num_buckets: int = 8,
              epochs: int = 200, seed: int = 0, num_hash: int = 256, window: int = 64,
              lr: float = 0.05, l2: float = 1e-4, batch_size: int = 256) -> "DecodeLengthPredictor":
        """Fit on (prompt ids, actual output length) pairs: mini-batch Adam on
        the softmax cross-entropy, seeded shuffles, zero init."""
        import numpy as np

        if not pairs or num_buckets < 2:
            raise ValueError("train needs at least one pair and num_buckets >= 2")
        dim = 3 + _NUM_LEN_BANDS + num_hash
        x = np.zeros((len(pairs), dim))
        for r, (ids, _) in enumerate(pairs):
            for i, v in featurize(ids, num_hash, window).items():
                x[r, i] = v
        y = np.array([bucket_of(n, num_buckets) for _, n in pairs])
        onehot = np.eye(num_buckets)[y]                      # (N, K)
        w = np.zeros((dim, num_buckets))                     # (D, K)
        m, v = np.zeros_like(w), np.zeros_like(w)
        rng, step = np.random.default_rng(seed), 0
        for _ in range(epochs):
            order = rng.permutation(len(pairs))
            for s in range(0, len(order), batch_size):
                idx = order[s:s + batch_size]
                logits = x[idx] @ w
                p = np.exp(logits - logits.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                grad = x[idx].T @ (p - onehot[idx]) / len(idx) + l2 * w
                step += 1
                m = 0.9 * m + 0.1 * grad
                v = 0.999 * v + 0.001 * grad * grad
                w -= lr * (m / (1 - 0.9 ** step)) / (np.sqrt(v / (1 - 0.999 ** step)) + 1e-8)
        meta = {"num_train": len(pairs), "epochs": epochs, "seed": seed, "lr": lr, "l2": l2}
        return cls(w.T.tolist(), num_hash, window, meta)

    def logits(self, prompt_ids: Sequence[int]) -> list[float]:
        feats = featurize(prompt_ids, self.num_hash, self.window)
        return [sum(row[i] * v for i, v in feats.items()) for row in self.weights]

    def predict_bucket(self, prompt_ids: Sequence[int]) -> int:
        scores = self.logits(prompt_ids)
        return max(range(len(scores)), key=scores.__getitem__)  # ties: lowest bucket

    def predict_length(self, prompt_ids: Sequence[int]) -> int:
        return BUCKET_SIZE * self.predict_bucket(prompt_ids) + BUCKET_SIZE // 2

    def confusion(self, pairs: Sequence[tuple[Sequence[int], int]]) -> list[list[int]]:
        """counts[actual bucket][predicted bucket]."""
        k = self.num_buckets
        counts = [[0] * k for _ in range(k)]
        for ids, n in pairs:
            counts[bucket_of(n, k)][self.predict_bucket(ids)] += 1
        return counts

    def accuracy(self, pairs: Sequence[tuple[Sequence[int], int]]) -> float:
        if not pairs:
            return 0.0
        counts = self.confusion(pairs)
        return sum(counts[i][i] for i in range(self.num_buckets)) / len(pairs)

    def save(self, path: str | Path) -> None:
        data = {"format": PREDICTOR_FORMAT, "bucket_size": BUCKET_SIZE,
                "num_buckets": self.num_buckets, "num_hash": self.num_hash,
                "window": self.window, "metadata": self.metadata, "weights": self.weights}
        Path(path).write_text(json.dumps(data) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "DecodeLengthPredictor":
        data = _read_json(path, "decode predictor")
        try:
            if data["format"] != PREDICTOR_FORMAT or data["bucket_size"] != BUCKET_SIZE:
                raise PDConfigError(f"format must be {PREDICTOR_FORMAT!r} with bucket_size "
                                    f"{BUCKET_SIZE}")
            weights = data["weights"]
            if len(weights) != data["num_buckets"]:
                raise PDConfigError(f"{len(weights)} weight rows for {data['num_buckets']} buckets")
            return cls(weights, data["num_hash"], data["window"], data.get("metadata"))
        except (KeyError, TypeError, ValueError) as e:
            raise PDConfigError(f"decode predictor file {str(path)!r}: {e!r}") from None


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

    def choose(self, prompt_ids: Sequence[int], te_types: Collection[str] | None = None) -> str:
        return self.decide(prompt_ids, te_types).te_type

    def decide(self, prompt_ids: Sequence[int],
               te_types: Collection[str] | None = None) -> PDDecision:
        """te_types: the TEInfo.te_type values in the TE list, if known; a choice
        whose TEs are absent ("disaggregated" needs prefill and decode TEs)
        turns into the other type when that one is present."""
        p = len(prompt_ids)
        if self.mode in ("colocated", "disaggregated"):
            d = PDDecision(self.mode, "fixed", f"mode {self.mode}", p)
        elif self.mode == "heatmap":
            d = self._by_heatmap(prompt_ids)
        else:
            d = self._by_threshold(prompt_ids, self._predict(prompt_ids), "")
        if te_types is not None:
            d = self._available(d, te_types)
        self.last_decision = d
        return d

    def _predict(self, prompt_ids: Sequence[int]) -> int | None:
        return self.predictor.predict_length(prompt_ids) if self.predictor else None

    def _by_heatmap(self, prompt_ids: Sequence[int]) -> PDDecision:
        p, dl = len(prompt_ids), self.predictor.predict_length(prompt_ids)
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
