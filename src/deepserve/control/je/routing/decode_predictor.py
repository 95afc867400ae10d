"""Decode-length predictor: multinomial logistic regression over 128-token
buckets (bucket k = [128k, 128(k+1)), the top one open-ended). Features, all
from the prompt ids alone (featurize()):
  dense   bias, l = log2(1 + n) / 13, l^2, one-hot of floor(log2(1 + n)) in 0..15
  hashed  num_hash (256) buckets of the last `window` (64) token ids, each id
          hashed by a 32-bit integer mix, term frequency (count / ids in the window)
Training (numpy, imported lazily) is seeded mini-batch Adam with L2; inference
is pure Python over the ~80 non-zero features (the JE runs it per job, so
the predictor memoizes each token id's hashed index, and logits() gathers
each row's weights with itemgetter and sums their products in C, in the
features' order: the same floats as the plain sum). predict_length() returns
the bucket midpoint 128k + 64 (the top bucket too).
"""

from __future__ import annotations

import json
import math
from operator import itemgetter, mul
from pathlib import Path
from typing import Sequence

from deepserve.control.je.routing.pd_heatmap import PDConfigError, _read_json

PREDICTOR_FORMAT = "deepserve.decode_predictor/1"
BUCKET_SIZE = 128
_NUM_LEN_BANDS = 16
_MAX_SLOTS = 1 << 18  # token ids whose hashed index a predictor memoizes


# -- decode-length predictor ---------------------------------------------------------
def _mix32(x: int) -> int:
    x = (x * 0x9E3779B1) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    return x ^ (x >> 13)


def featurize(prompt_ids: Sequence[int], num_hash: int = 256, window: int = 64,
              slots: dict[int, int] | None = None) -> dict[int, float]:
    """Sparse features {index: value} of a prompt (see the module doc);
    slots: a memo token id -> hashed feature index, for this num_hash only."""
    n = len(prompt_ids)
    log_len = math.log2(1 + n)
    scaled = log_len / 13.0
    feats = {0: 1.0, 1: scaled, 2: scaled * scaled, 3 + min(int(log_len), _NUM_LEN_BANDS - 1): 1.0}
    tail = prompt_ids[-window:] if window > 0 else ()
    if tail:
        base, w = 3 + _NUM_LEN_BANDS, 1.0 / len(tail)
        memo = {} if slots is None else slots
        for t in tail:
            i = memo.get(t)
            if i is None:
                i = memo[t] = base + _mix32(int(t)) % num_hash
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
        self._slots: dict[int, int] = {}  # featurize's memo

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
        """Per bucket, sum(row[i] * v for i, v in features), in that order."""
        if len(self._slots) > _MAX_SLOTS:
            self._slots.clear()
        feats = featurize(prompt_ids, self.num_hash, self.window, self._slots)
        pick, values = itemgetter(*feats), list(feats.values())  # >= 4 features: tuples
        return [sum(map(mul, pick(row), values)) for row in self.weights]

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
