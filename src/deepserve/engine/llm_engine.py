"""LLMEngine: one TE's step loop in one process.

    add_request ──> Scheduler.waiting ──schedule()──> StepBatch ──> ModelRunner
                                                                      │
    RequestOutput <── detokenize, stop strings <── update() <── StepOutput

The ModelRunner is the seam: with worker processes the same StepBatch goes
over a broadcast ring instead of a function call.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.config import EngineConfig
from deepserve.engine.output_processor import RequestState
from deepserve.engine.outputs import RequestOutput, TokenLogprob
from deepserve.engine.request_checks import check_prompt_ids
from deepserve.engine.scheduler import Scheduler
from deepserve.engine.sequence import Sequence
from deepserve.tokenizer import Tokenizer
from deepserve.errors import InvalidRequestError
from deepserve.messages.sampling import SamplingParams
from deepserve.model.loader import load_model
from deepserve.worker.model_runner import ModelRunner


@dataclass
class _Request:
    state: RequestState
    seq: Sequence

    @property
    def request_id(self) -> str:
        return self.state.request_id


class LLMEngine:
    def __init__(self, config: EngineConfig):
        model = load_model(config.model, config.dtype)
        self.model_config = model.config
        self.tokenizer = Tokenizer(config.model)
        self.config = config.resolve(
            model.config.max_position_embeddings,
            ModelRunner.kv_bytes_per_block(model.config, config.block_size))
        c = self.config
        self.kv = KVCacheManager(c.num_kv_blocks, c.block_size, c.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, c.max_num_batched_tokens, c.max_num_seqs,
                                   c.max_model_len)
        self.runner = ModelRunner(model, c.num_kv_blocks, c.block_size, c.seed)
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._released_seq_ids: list[int] = []
        self._seq_ids = itertools.count()
        self._step_ids = itertools.count()
        self._request_ids = itertools.count()

    # -- requests ------------------------------------------------------------
    def add_request(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None, salt: str | None = None) -> str:
        """Validate and queue one request; raise InvalidRequestError on bad input
        (nothing is queued then, and running requests are unaffected)."""
        sampling = (sampling or SamplingParams()).validate(self.model_config.vocab_size)
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        is_ids = isinstance(prompt, (list, tuple))
        prompt_text, ids = self.tokenizer.request_ids(None if is_ids else prompt,
                                                      prompt if is_ids else None)
        check_prompt_ids(ids, self.model_config.vocab_size, self.config.max_model_len)
        stops = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stops.update(self.model_config.eos_token_ids)
        seq = Sequence(next(self._seq_ids), ids, sampling, frozenset(stops), salt)
        req = _Request(RequestState(request_id, prompt_text, ids, sampling, self.tokenizer), seq)
        self._requests[request_id] = self._by_seq[seq.seq_id] = req
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            self.scheduler.finish(req.seq, "abort")
            self._release(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step --------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that advanced."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        batch = scheduled.to_step_batch(next(self._step_ids), self.kv, self._released_seq_ids)
        self._released_seq_ids = []
        output = self.runner.execute(batch)
        advanced = self.scheduler.update(scheduled, output.sampled)
        return [self._emit(self._by_seq[seq.seq_id]) for seq in advanced]

    def _emit(self, req: _Request) -> RequestOutput:
        seq = req.seq
        delta = req.state.add_tokens([seq.token_ids[-1]], seq.finish_reason)
        if req.state.finish_reason == "stop" and not seq.is_finished:
            self.scheduler.finish(seq, "stop")  # a stop string
        if req.state.is_finished:
            self._release(req)
        return self._output(req, delta)

    def _release(self, req: _Request) -> None:
        self._requests.pop(req.request_id, None)
        if self._by_seq.pop(req.seq.seq_id, None) is not None and req.seq.is_known_to_workers:
            self._released_seq_ids.append(req.seq.seq_id)

    def _output(self, req: _Request, delta: str) -> RequestOutput:
        seq, state = req.seq, req.state
        logprobs = None
        if seq.sampling.logprobs is not None:
            logprobs = [TokenLogprob(t.token_id, t.logprob, t.top or []) for t in seq.logprobs]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             seq.output_token_ids, state.text, state.finish_reason,
                             seq.num_cached_tokens or 0, logprobs, delta)
