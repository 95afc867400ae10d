"""StepCore: one TE's request bookkeeping, shared by both step loops.

    LLMEngine (in-process) ─┐                        ┌─> Scheduler ──> StepBatch
                            ├─> StepCore: add, finish ┤
    Master (process mode) ──┘   release, schedule    └─> KVCacheManager

A request enters as `add(request_id, ids, sampling, salt)`: its stop tokens
(the request's own, plus the model's EOS unless ignore_eos; always with a
grammar, whose end allows only EOS) are assembled here and nowhere else. It leaves through `release(seq)` exactly once, after
it finished (stop, length, abort): the workers hear the sequence id with the
next batch, so they drop its sampling state. `check_request` is the one
validation every entry point runs before anything is queued (the tokenizer
process runs it too, so a bad request never reaches the master).

Sampling fields a request leaves unset take the model's generation defaults
(checkpoint.GenerationDefaults) where it enters the TE: the tokenizer process
(which knows a resumed attempt's output count) in process mode, add_request
in-process. add() resolves whatever is still unset (nothing, on those paths),
so every Sequence carries concrete values, and a prefill order carries the
decode TE's own: the prefill TE samples the first token with them.

A request that asks for prompt_logprobs gets a prefix-cache salt of its own
(no prefix is shared with it, in any tier: every prompt position must be
computed to have its logprob), and a decode TE prefills it itself rather
than from a prefill TE (the logprobs are made where the client's stream is).
"""

from __future__ import annotations

import itertools
from typing import Hashable, Iterable

import msgspec

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.checkpoint import GenerationDefaults
from deepserve.config import EngineConfig
from deepserve.engine.scheduler import Scheduler, SchedulerOutput
from deepserve.engine.sequence import Sequence
from deepserve.errors import InvalidRequestError, PromptTooLongError
from deepserve.messages.sampling import SamplingParams
from deepserve.messages.step import StepBatch


def with_request_words(sampling: SamplingParams, tokenizer, num_resumed: int = 0
                       ) -> SamplingParams:
    """The parts of a request that need its model's tokenizer: bad_words as
    token sequences (each word, and with a leading space, as vLLM does), and
    a grammar checked (it compiles: InvalidRequestError naming the field)
    and told how many prompt tokens are output already (a resumed attempt's)."""
    changes = {}
    if sampling.bad_words and not sampling.bad_words_ids:
        seqs = {tuple(tokenizer.encode(text, add_special_tokens=False))
                for word in sampling.bad_words for text in (word, " " + word.lstrip())}
        changes["bad_words_ids"] = [list(s) for s in sorted(seqs) if s]
    if sampling.structured is not None:
        from deepserve.structured.compile import check
        check(sampling.structured, sampling.structured.field)
        if num_resumed != sampling.structured.num_replayed:
            changes["structured"] = msgspec.structs.replace(sampling.structured,
                                                            num_replayed=num_resumed)
    return msgspec.structs.replace(sampling, **changes) if changes else sampling


def check_request(ids: list[int], sampling: SamplingParams, vocab_size: int,
                  max_model_len: int) -> None:
    """Raise InvalidRequestError (PromptTooLongError) naming the bad field."""
    sampling.validate(vocab_size)
    if not ids:
        raise InvalidRequestError("prompt is empty (no tokens)", "prompt")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})",
                                  "prompt")
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"prompt has {len(ids)} tokens; max_model_len is {max_model_len}, which must leave "
            f"room for at least one generated token", "prompt")


class StepCore:
    """config: resolved (num_kv_blocks and max_model_len set). record_events:
    keep the prefix tree's insert/evict events and the finished request ids
    for a cluster manager's reports (else nothing accumulates)."""

    def __init__(self, config: EngineConfig, eos_token_ids: Iterable[int], vocab_size: int,
                 record_events: bool = False, collect_new_nodes: bool = False):
        self.config = config
        self.generation = GenerationDefaults.load(config.model)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.record_events = record_events
        self.kv = KVCacheManager(config.num_kv_blocks, config.block_size,
                                 config.enable_prefix_caching, record_events=record_events,
                                 collect_new_nodes=collect_new_nodes)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.max_model_len, light_step_tokens=config.light_step_tokens)
        self.seqs: dict[str, Sequence] = {}  # request id -> its sequence, until released
        self.request_ids: dict[int, str] = {}  # seq id -> request id
        self.released: list[int] = []  # seq ids the workers drop with the next batch
        self.finished_ids: list[str] = []  # for reports (record_events only)
        self.num_prompt_tokens = self.num_cached_tokens = 0  # of released requests
        self.num_device_hits = 0  # cached tokens its own device pool served (not a peer's)
        self._seq_ids, self._step_ids = itertools.count(), itertools.count()

    # -- requests -----------------------------------------------------------------
    def check(self, request_id: str, ids: list[int], sampling: SamplingParams) -> None:
        check_request(ids, sampling, self.vocab_size, self.config.max_model_len)
        if request_id in self.seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use",
                                      "request_id")

    def resolve(self, sampling: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """sampling with its unset fields filled from the model's defaults."""
        return self.generation.apply(sampling, num_prompt_tokens, self.config.max_model_len)

    def stop_token_ids(self, sampling: SamplingParams) -> frozenset[int]:
        stops = frozenset(sampling.stop_token_ids)
        if sampling.ignore_eos and sampling.structured is None:
            return stops
        return stops | self.eos_token_ids  # a finished grammar allows only EOS: it ends there

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def add(self, request_id: str, ids: list[int], sampling: SamplingParams,
            salt: Hashable = None, schedule: bool = True) -> Sequence:
        """A tracked sequence for the request, queued unless schedule=False
        (a decode task waits for its KV from a prefill TE first)."""
        sampling = self.resolve(sampling, len(ids))
        seq_id = self.new_seq_id()
        if sampling.prompt_logprobs is not None:  # every position computed: no shared prefix
            salt = f"{salt or ''}\x00prompt-logprobs-{seq_id}"
        seq = Sequence(seq_id, ids, sampling, self.stop_token_ids(sampling), salt)
        self.track(request_id, seq)
        if schedule:
            self.scheduler.add(seq)
        return seq

    def track(self, request_id: str, seq: Sequence, is_request: bool = True) -> None:
        """Bookkeeping for a sequence. is_request=False (a prefill task made by
        engine/pd/prefill.py for another TE's request): by seq id only, so it
        never takes the request-id slot of a request this TE serves."""
        if is_request:
            self.seqs[request_id] = seq
        self.request_ids[seq.seq_id] = request_id

    def finish(self, request_id: str, reason: str) -> Sequence | None:
        """Stop a request (abort, a stop string) and release it; None if unknown."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            self.scheduler.finish(seq, reason)
            self.release(seq)
        return seq

    def fail(self, seq: Sequence) -> str | None:
        """A worker could not serve this sequence (StepOutput.failed): finish it
        with reason "error" and release it; its request id (None if released)."""
        if seq.is_finished and seq.seq_id not in self.request_ids:
            return None
        self.scheduler.finish(seq, "error")
        return self.release(seq)

    def release(self, seq: Sequence) -> str | None:
        """Forget a finished sequence; its request id (None if released already)."""
        request_id = self.request_ids.pop(seq.seq_id, None)
        if request_id is None:
            return None
        if self.seqs.get(request_id) is seq:  # else a later attempt holds the id now
            del self.seqs[request_id]
        if self.record_events and not seq.keep_kv:  # a prefill task ends on the decode TE
            self.finished_ids.append(request_id)
        self.num_prompt_tokens += seq.num_prompt_tokens
        self.num_cached_tokens += seq.num_cached_tokens or 0
        if not seq.kv_from_peer:  # a decode task's cached tokens are its prefill TE's
            self.num_device_hits += max(0, (seq.num_cached_tokens or 0)
                                        - sum(seq.tier_tokens.values()))
        if seq.is_known_to_workers:
            self.released.append(seq.seq_id)
        return request_id

    # -- steps --------------------------------------------------------------------
    def schedule(self) -> tuple[SchedulerOutput, StepBatch] | None:
        """The next step and its wire form, or None when there is nothing to run."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return None
        batch = scheduled.to_step_batch(next(self._step_ids), self.kv, self.released)
        self.released = []
        return scheduled, batch

    def pop_finished(self) -> list[str]:
        finished, self.finished_ids = self.finished_ids, []
        return finished
