"""The job executor's view of many models: which model a request is for,
its tokenizer, which TEs serve it, and the demand the autoscaler hears of.

    SubmitRequest.model ──ModelBook.name_of──> a served model (None: the first)
        ──prompts(model)──> its PromptTokens (created on first use: bounded, cached)
        ──te_model(model)──> the TEInfo.model its TEs carry (None: any): the router's filter
    arrivals, parked ──demand()──> ModelDemand ──(the JE pushes it)──> CM autoscaler

One model (the node's [[te]] TEs, or a test's JE given a directory): every
TE serves it, whatever name it announces. Several: a TE serves the model
its TEInfo.model names.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Mapping

from deepserve.control.je.admission import PromptTokens
from deepserve.errors import InvalidRequestError
from deepserve.messages.scaling import ModelDemand
from deepserve.tokenizer import Tokenizer

MAX_SAMPLES = 1000
DEMAND_INTERVAL_S = 1.0
"""While requests are held, the demand is repeated this often (a restarted CM hears it)."""


class ModelBook:
    """models: served name -> model directory (the first is the default), or
    one directory; scalable: the names the autoscaler starts on demand."""

    def __init__(self, models: Mapping[str, str] | str, scalable: Iterable[str] = (),
                 clock: Callable[[], float] = time.monotonic):
        self.models = {Path(models).name: str(models)} if isinstance(models, str) \
            else dict(models)
        if not self.models:
            raise ValueError("a job executor needs at least one model")
        self.default = next(iter(self.models))
        self.scalable = frozenset(scalable)
        self.clock = clock
        self._prompts: dict[str, PromptTokens] = {}
        self.arrivals: Counter[str] = Counter()
        self.parked: Counter[str] = Counter()
        self.latencies: dict[str, list] = {}  # add_latencies, until the next demand()
        self._sent_parked: dict[str, int] = {}
        self._sent_at = float("-inf")

    @property
    def is_multi(self) -> bool:
        return len(self.models) > 1

    def name_of(self, requested: str | None) -> str:
        """The served model a request is for; InvalidRequestError for an unknown name."""
        if requested is None or (not self.is_multi and requested not in self.models):
            return self.default  # one model: the gateway checked the name it serves
        if requested not in self.models:
            raise InvalidRequestError(f"The model {requested!r} does not exist.", "model")
        return requested

    def prompts(self, model: str) -> PromptTokens:
        if model not in self._prompts:
            path = self.models[model]
            self._prompts[model] = PromptTokens.for_model(path, Tokenizer(path))
        return self._prompts[model]

    def te_model(self, model: str) -> str | None:
        """The TEInfo.model of the TEs that serve `model`; None when the node
        serves one model (every TE serves it, whatever name it announces)."""
        return model if self.is_multi else None

    def waits_for_scaling(self, model: str) -> bool:
        return model in self.scalable

    # -- demand --------------------------------------------------------------------
    def note_arrival(self, model: str) -> None:
        self.arrivals[model] += 1

    def add_latencies(self, samples: Mapping[str, list]) -> None:
        """A gateway's TTFT / TPOT samples (bounded: the newest MAX_SAMPLES per model)."""
        for model, values in samples.items():
            if model in self.models:
                kept = self.latencies.setdefault(model, [])
                kept.extend(values)
                del kept[:-MAX_SAMPLES]

    def demand(self, parked: Iterable[str]) -> ModelDemand | None:
        """What the autoscaler should hear now (parked: the model of every held
        request), or None: new arrivals, a change in what is held, or held
        requests not reported for DEMAND_INTERVAL_S."""
        now_parked = dict(Counter(parked))
        now = self.clock()
        due = now_parked and now - self._sent_at >= DEMAND_INTERVAL_S
        if not self.arrivals and not self.latencies and now_parked == self._sent_parked \
                and not due:
            return None
        msg = ModelDemand(arrivals=dict(self.arrivals),
                          parked={m: now_parked.get(m, 0) for m in
                                  set(now_parked) | set(self._sent_parked)},
                          latencies=self.latencies)
        self.arrivals.clear()
        self.latencies = {}
        self._sent_parked, self._sent_at = now_parked, now
        return msg
