"""LLMEngine: one TE's step loop in one process.

    add_request ──> Scheduler.waiting ──schedule()──> StepBatch ──> ModelRunner
                                                                      │
    RequestOutput <── detokenize, stop strings <── update() <── StepOutput

The ModelRunner is the seam: with worker processes the same StepBatch goes
over a broadcast ring instead of a function call.
"""

from __future__ import annotations

import itertools

from deepserve.config import EngineConfig
from deepserve.engine.api.outputs import RequestOutput, TokenLogprob
from deepserve.engine.output_processor import RequestState
from deepserve.engine.sequence import Sequence
from deepserve.engine.step_core import StepCore, with_request_words
from deepserve.structured.matchers import GrammarBook
from deepserve.messages.sampling import SamplingParams
from deepserve.model import kernels
from deepserve.model.loader import load_model
from deepserve.tokenizer import Tokenizer
from deepserve.worker.model_runner import ModelRunner


class LLMEngine:
    def __init__(self, config: EngineConfig):
        kernels.start_flushing_denormals()  # before loading starts torch's threads
        model = load_model(config.model, config.dtype, quantize=config.quantize)
        self.model_config = model.config
        self.tokenizer = Tokenizer(config.model)
        self.config = config.resolve(
            model.config.max_position_embeddings,
            model.config.kv_bytes_per_block(config.block_size))
        c = self.config
        self.core = StepCore(c, model.config.eos_token_ids, model.config.vocab_size)
        self.kv, self.scheduler = self.core.kv, self.core.scheduler
        self.runner = ModelRunner(model, c.num_kv_blocks, c.block_size, c.seed)
        self.runner.grammars = GrammarBook(config.model, model.config.vocab_size,
                                           model.config.eos_token_ids)
        self._states: dict[str, RequestState] = {}  # request id -> its text so far
        self._request_ids = itertools.count()

    # -- requests ------------------------------------------------------------
    def add_request(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None, salt: str | None = None) -> str:
        """Validate and queue one request; raise InvalidRequestError on bad input
        (nothing is queued then, and running requests are unaffected)."""
        sampling = sampling or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        is_ids = isinstance(prompt, (list, tuple))
        prompt_text, ids = self.tokenizer.request_ids(None if is_ids else prompt,
                                                      prompt if is_ids else None)
        sampling = self.core.resolve(sampling, len(ids))  # the model's defaults, once
        sampling = with_request_words(sampling, self.tokenizer)
        self.core.check(request_id, ids, sampling)
        self._states[request_id] = RequestState(request_id, prompt_text, ids, sampling,
                                                self.tokenizer)
        self.core.add(request_id, ids, sampling, salt)
        return request_id

    def abort_request(self, request_id: str) -> None:
        if self.core.finish(request_id, "abort") is not None:
            del self._states[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step --------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that advanced."""
        step = self.core.schedule()
        if step is None:
            return []
        scheduled, batch = step
        output = self.runner.execute(batch)
        advanced = self.scheduler.update(scheduled, output.sampled)
        outputs = [self._emit(seq) for seq in advanced]
        for failure in output.failed:  # that request alone ends, finish_reason "error"
            seq = scheduled.seqs[failure.seq_id]
            request_id = self.core.fail(seq)
            if request_id is not None:
                state = self._states.pop(request_id)
                state.finish_reason = "error"
                outputs.append(self._output(state, seq, ""))
        return outputs

    def _emit(self, seq: Sequence) -> RequestOutput:
        request_id = self.core.request_ids[seq.seq_id]
        state = self._states[request_id]
        delta = state.add_tokens([seq.token_ids[-1]], seq.finish_reason)
        if state.finish_reason == "stop" and not seq.is_finished:
            self.scheduler.finish(seq, "stop")  # a stop string
        if state.is_finished:
            self.core.release(seq)
            del self._states[request_id]
        return self._output(state, seq, delta)

    @staticmethod
    def _output(state: RequestState, seq: Sequence, delta: str) -> RequestOutput:
        logprobs = None
        if seq.sampling.logprobs is not None:
            logprobs = [TokenLogprob(t.token_id, t.logprob, t.top or []) for t in seq.logprobs]
        prompt = None if seq.prompt_logprobs is None else [
            TokenLogprob(t, lp, top) for t, lp, top in seq.prompt_logprobs]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             seq.output_token_ids, state.text, state.finish_reason,
                             seq.num_cached_tokens or 0, logprobs, delta, prompt)
