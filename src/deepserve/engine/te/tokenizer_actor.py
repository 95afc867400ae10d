"""The TE's tokenizer / detokenizer process: no text work on the master's loop.

    client ──SubmitRequest/AbortRequest──> [inbox PULL] ──AddRequest/FinishRequest──> master
    master ──StepTokens/FailRequest──────> [inbox PULL] ──RequestDelta/RequestFailed──> client
                                                          (the streaming shortcut)

A request's unset sampling fields take the model's generation defaults
here, once (checkpoint.GenerationDefaults; a resumed attempt's max_new_tokens
counts the output it already has), and it is validated here
(step_core.check_request, the check the in-process engine runs too), before
it reaches the batch; a bad one is answered with RequestFailed and never
reaches the master. A message that is valid but wrong (an unknown or
duplicate request id, token ids outside the vocabulary) is answered or
dropped, never fatal; a request whose caller does not take its deltas
(Outboxes.put False: gone or stalled) is aborted in the TE, so no batch slot
generates for nobody. A request that ends here, any
way, is told to its job executor (TaskDone to done_to) once. Stop strings are
found here (on text), so this process also tells the master to stop them.
A delta with logprobs carries the bytes of every token they name
(RequestDelta.token_bytes): the gateway shows token strings from them.
PD messages between TEs go master to master (messages/pd.py), not through here.
"""

from __future__ import annotations

import logging
import time
from multiprocessing.connection import Connection

import zmq

from deepserve.actor import ActorLife
from deepserve.checkpoint import GenerationDefaults
from deepserve.config import EngineConfig
from deepserve.engine.output_processor import RequestState
from deepserve.engine.step_core import check_request, with_request_words
from deepserve.engine.te.specs import TokenizerSpec
from deepserve.errors import InvalidRequestError, PromptTooLongError
from deepserve.ipc import curve
from deepserve.ipc.outboxes import Outboxes
from deepserve.ipc.sockets import PullSocket, PushSocket
from deepserve.ipc.timeline import Timeline, token_key
from deepserve.structured.compile import ensure_loaded
from deepserve.messages.engine import (AbortRequest, AddRequest, FinishRequest, GetStats,
                                       NewTokens, RequestDelta, RequestFailed, StepTokens,
                                       SubmitRequest, TaskDone, ToTokenizer)
from deepserve.messages.pd import FailRequest
from deepserve.model.config import load_model_config
from deepserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def tokenizer_main(spec: TokenizerSpec, death_pipe: Connection, ready_pipe: Connection) -> None:
    life = ActorLife("tokenizer", death_pipe, component=f"{spec.te_id}/tokenizer")
    ctx = zmq.Context()
    actor = None
    try:
        actor = TokenizerActor(spec, ctx)
        actor.beat = lambda: life.beat({"messages": actor.num_handled})
        ready_pipe.send(("ready", None))
        life.ready()
        # A pipeline stage: judged by liveness, never hung (holds no work of its own).
        life.run(actor.step, lambda: {"messages": actor.num_handled})
    except Exception as e:
        log.exception("tokenizer failed")
        ready_pipe.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1)
    finally:
        if actor is not None:
            actor.close()  # every socket closed, or ctx.term() waits forever
        ctx.term()
        life.close()


class TokenizerActor:
    def __init__(self, spec: TokenizerSpec, ctx: zmq.Context):
        self.config = spec.config
        self.tokenizer = Tokenizer(spec.config.model)
        self.vocab_size = load_model_config(spec.config.model).vocab_size
        self.generation = GenerationDefaults.load(spec.config.model)
        self.inbox = PullSocket(ctx, spec.listen_address, bind=True, type=ToTokenizer,
                                admit=curve.from_head)  # secure: a head's JE only
        self.to_master = PushSocket(ctx, spec.master_address, bind=False)
        self.ctx, self.client_address = ctx, spec.client_address
        self.replies = Outboxes(ctx)  # a gone or bogus reply_to drops, never blocks
        self.reply_to: dict[str, str] = {}  # request id -> its caller's address
        self.attempts: dict[str, int] = {}  # request id -> attempt (resumed requests)
        self.done_to: dict[str, str] = {}  # request id -> its JE's inbox (TaskDone)
        self.queued_s: dict[str, float] = {}  # request id -> its wait in the JE (first delta)
        self.states: dict[str, RequestState] = {}
        self.num_handled = 0
        self.beat = None  # the process's heartbeat while xgrammar loads, if any
        self.num_undeliverable = 0  # requests aborted because their caller took no reply
        self.timeline = Timeline(f"{spec.te_id}/tokenizer", spec.config.timeline_dir)
        self._detok_s = self._reply_s = 0.0  # this StepTokens' parts (timeline on)

    def step(self) -> None:
        """One message, or a 0.2 s wait (the life loop's bound)."""
        try:
            msg = self.inbox.get(timeout=0.2)
        except TimeoutError:
            return
        self.handle(msg)
        self.num_handled += 1

    def close(self) -> None:
        self.timeline.close()
        for sock in [self.inbox, self.to_master, self.replies]:
            sock.close()

    def _reply(self, request_id: str, msg, first: bool = False) -> bool:
        """Send to the caller that submitted request_id (one socket per caller);
        False if it did not take the message (gone, or not reading). first:
        the request's first reply, whose caller has just sent it: waited for
        even if the address stalled before (a gateway restarted there)."""
        address = self.reply_to.get(request_id, self.client_address)
        return self.replies.put(address, msg, probe=first)

    def _forget(self, request_id: str) -> None:
        self.reply_to.pop(request_id, None)
        attempt = self.attempts.pop(request_id, 0)
        self.queued_s.pop(request_id, None)
        done_to = self.done_to.pop(request_id, None)
        if done_to is not None:
            self.replies.put(done_to, TaskDone(request_id=request_id, attempt=attempt))

    def handle(self, msg) -> None:
        if isinstance(msg, SubmitRequest):
            self._submit(msg)
        elif isinstance(msg, AbortRequest):
            if self.states.pop(msg.request_id, None) is not None:
                self.to_master.put(FinishRequest(request_id=msg.request_id, reason="abort"))
                self._reply(msg.request_id, RequestDelta(request_id=msg.request_id, text="",
                                                         token_ids=[], finish_reason="abort"))
                self._forget(msg.request_id)
        elif isinstance(msg, StepTokens):
            start = time.monotonic()
            self._detok_s = self._reply_s = 0.0
            for item in msg.items:
                self._tokens(item, msg.step_id)
            if self.timeline.on:  # two spans laid end to end: the sums of each part
                mid = start + self._detok_s
                self.timeline.add("detokenize", msg.step_id, start, mid, len(msg.items))
                self.timeline.add("reply", msg.step_id, mid, mid + self._reply_s)
        elif isinstance(msg, GetStats):
            self.to_master.put(msg)  # behind every request sent before it
        elif isinstance(msg, FailRequest):
            if self.states.pop(msg.request_id, None) is not None:
                self._reply(msg.request_id, RequestFailed(request_id=msg.request_id,
                                                          error=msg.error, message=msg.message))
                self._forget(msg.request_id)

    def _submit(self, msg: SubmitRequest) -> None:
        if msg.request_id in self.states:  # before anything of the live one is touched
            self.replies.put(msg.reply_to or self.client_address, RequestFailed(
                request_id=msg.request_id, error="invalid_request", param="request_id",
                message=f"request id {msg.request_id!r} is in use"))
            return
        if msg.reply_to is not None:
            self.reply_to[msg.request_id] = msg.reply_to
        if msg.attempt:
            self.attempts[msg.request_id] = msg.attempt
        if msg.done_to is not None:
            self.done_to[msg.request_id] = msg.done_to
        if msg.queued_s:
            self.queued_s[msg.request_id] = msg.queued_s
        try:
            prompt, ids = self.tokenizer.request_ids(
                msg.prompt, msg.prompt_token_ids, msg.messages,
                msg.chat.render_options() if msg.chat is not None else None)
            sampling = self.generation.apply(msg.sampling, len(ids), self.config.max_model_len,
                                             msg.resumed_output_ids)
            if sampling.structured is not None:  # the first one loads xgrammar, beating
                ensure_loaded(self.beat)
            sampling = with_request_words(sampling, self.tokenizer, msg.resumed_output_ids)
            check_request(ids, sampling, self.vocab_size, self.config.max_model_len)
        except Exception as e:  # InvalidRequestError, or content no tokenizer can take
            if not isinstance(e, InvalidRequestError):
                log.warning("request %r refused: %s: %s", msg.request_id, type(e).__name__, e)
                e = InvalidRequestError(f"the request cannot be tokenized: {e}")
            error = "prompt_too_long" if isinstance(e, PromptTooLongError) else e.code
            self._reply(msg.request_id, RequestFailed(request_id=msg.request_id, error=error,
                                                      message=str(e), param=e.param))
            self._forget(msg.request_id)
            return
        self.states[msg.request_id] = RequestState(
            msg.request_id, prompt, ids, sampling, self.tokenizer,
            resumed_output_ids=msg.resumed_output_ids,
            resumed_text_chars=msg.resumed_text_chars)
        self.to_master.put(AddRequest(request_id=msg.request_id, prompt_token_ids=ids,
                                      sampling=sampling, salt=msg.salt,
                                      prefill_from=msg.prefill_from,
                                      pin_context=msg.pin_context, read_path=msg.read_path,
                                      tenant=msg.tenant, tenant_weight=msg.tenant_weight))

    def _tokens(self, item: NewTokens, step_id: int) -> None:
        state = self.states.get(item.request_id)
        if state is None:
            return  # aborted, or stopped by a stop string a step ago
        if not all(0 <= t < self.vocab_size for t in item.token_ids):
            log.warning("tokens for %r outside the vocabulary: dropped", item.request_id)
            return  # never from our master: a crafted message
        is_first = not state.token_ids
        t0 = time.monotonic()
        delta = state.add_tokens(item.token_ids, item.finish_reason)
        if state.finish_reason == "stop" and item.finish_reason is None:
            self.to_master.put(FinishRequest(request_id=item.request_id, reason="stop"))
        token_bytes = self._token_bytes(item.logprobs, item.prompt_logprobs,
                                        state.prompt_token_ids[:1] if is_first else ())
        t1 = time.monotonic()
        delivered = self._reply(item.request_id, RequestDelta(
            request_id=item.request_id, text=delta, token_ids=item.token_ids,
            finish_reason=state.finish_reason, cached_tokens=item.cached_tokens,
            prompt=state.prompt if is_first else None,
            prompt_token_ids=state.prompt_token_ids if is_first else None,
            logprobs=item.logprobs, prompt_logprobs=item.prompt_logprobs,
            token_bytes=token_bytes, attempt=self.attempts.get(item.request_id, 0),
            queued_s=self.queued_s.pop(item.request_id, 0.0) if is_first else 0.0),
            first=is_first)
        self._detok_s += t1 - t0
        self._reply_s += time.monotonic() - t1
        if self.timeline.on:
            self.timeline.add("reply_item", step_id, t1, time.monotonic(), len(item.token_ids),
                              token_key(item.request_id, len(state.token_ids)))
        if state.is_finished:
            del self.states[item.request_id]
            self._forget(item.request_id)
        elif not delivered:  # its caller is gone or stalled: stop generating for nobody
            log.warning("caller of %r does not take its stream: aborting it", item.request_id)
            del self.states[item.request_id]
            self.to_master.put(FinishRequest(request_id=item.request_id, reason="abort"))
            self._forget(item.request_id)
            self.num_undeliverable += 1

    def _token_bytes(self, logprobs, prompt_logprobs, first: tuple | list
                     ) -> dict[int, bytes] | None:
        """The bytes of every token id the logprobs (and prompt logprobs) name,
        with the prompt's first token (`first`: echo shows it, with no logprob);
        None without logprobs (most tokens: nothing built)."""
        if not logprobs and not prompt_logprobs:
            return None
        ids = {i for token_id, _, top in (*(logprobs or ()), *(prompt_logprobs or ()))
               for i in (token_id, *(t for t, _ in top))}
        ids.update(first if prompt_logprobs else ())
        return {i: self.tokenizer.token_bytes(i) for i in ids}
