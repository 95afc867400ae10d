"""The autoscaler's SLO samples, as the gateway sees them: TTFT and TPOT of
each finished request, per model, sent to the JE (which passes them to the
cluster manager, control/cm/scaling.py) at most every INTERVAL_S.

    JobClient: a request's last delta ──note(model, timing, now)──> a batch, or None
"""

from __future__ import annotations

from deepserve.messages.scaling import RequestLatencies

INTERVAL_S = 1.0
MAX_SAMPLES = 1000
"""Per model per interval: the autoscaler needs rates, not every request."""


class LatencySamples:
    def __init__(self):
        self._samples: dict[str, list] = {}
        self._sent_at = 0.0

    def note(self, model: str, timing, now: float) -> RequestLatencies | None:
        """Add one request's (TTFT, TPOT) in ms; the batch to send when
        INTERVAL_S has passed since the last (then a new batch starts)."""
        if timing.first_token_at is None:
            return None
        ttft = (timing.first_token_at - timing.submitted_at) * 1e3
        tpot = None if timing.num_tokens < 2 else \
            (timing.finished_at - timing.first_token_at) * 1e3 / (timing.num_tokens - 1)
        samples = self._samples.setdefault(model, [])
        if len(samples) < MAX_SAMPLES:
            samples.append((round(ttft, 3), None if tpot is None else round(tpot, 3)))
        if now - self._sent_at < INTERVAL_S:
            return None
        batch = RequestLatencies(samples=self._samples)
        self._samples, self._sent_at = {}, now
        return batch
