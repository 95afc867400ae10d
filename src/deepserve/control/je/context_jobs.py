"""The job executor's context jobs: create (a prefill that pins), get, delete, expire.

    CreateContext ──tokenize──> begin ──dispatch(SubmitRequest: max_tokens 1,
        pin_context, reply_to = the JE)──> a TE ... its last RequestDelta ──> on_reply:
        registered, ContextInfo to the gateway | RequestFailed ──> retried once
        (te_lost) or passed on
    GetContext / DeleteContext ──> ContextInfo, or context_not_found (another
        tenant's id included); a deletion unpins the context in the tier service
    step ──expire──> ContextUnpin of each context past its expires_at
    PinTurn ──turn_pins (turn_pins.py)──> a turn that ended in tool calls held in host memory

It does its work through three callables the job executor gives it
(dispatch, reply, unpin), so it never touches the executor's state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from deepserve.control.je.contexts import MAX_TTL_S, MIN_TTL_S, Context, ContextBook
from deepserve.control.je.turn_pins import TurnPins
from deepserve.errors import InvalidRequestError
from deepserve.messages.cache import ContextPin
from deepserve.messages.contexts import ContextInfo, CreateContext, DeleteContext, GetContext
from deepserve.messages.engine import (RETRYABLE_ERRORS, RequestDelta, RequestFailed,
                                       SubmitRequest)
from deepserve.messages.sampling import SamplingParams

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 2
CREATE_TIMEOUT_S = 300.0
_PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass
class _Creating:
    request_id: str  # the gateway's
    reply_to: str
    submit: SubmitRequest
    deadline: float
    attempt: int = 0


class ContextJobs:
    def __init__(self, book: ContextBook, models, inbox: str, dispatch, reply, unpin,
                 clock=time.monotonic, turn_pin_s: float = 0.0):
        """models: the ModelBook; dispatch(SubmitRequest, ids): route and send a
        task; reply(address, msg); unpin(context id): tell the tier service;
        turn_pin_s: how long a turn that ended in tool calls is held (0: not)."""
        self.book, self.models, self.inbox = book, models, inbox
        self.dispatch, self.reply, self.unpin, self.clock = dispatch, reply, unpin, clock
        self.creating: dict[str, _Creating] = {}  # context id ->
        self.turn_pins = TurnPins(turn_pin_s, inbox, dispatch)

    def create(self, msg: CreateContext) -> None:
        try:
            ctx = self._new_context(msg)
        except InvalidRequestError as e:
            return self._fail(msg.request_id, msg.reply_to, e.code, str(e), e.param)
        if not self.book.can_create(msg.salt):
            return self._fail(msg.request_id, msg.reply_to, "too_many_contexts",
                              f"at most {self.book.max_per_tenant} live contexts per tenant")
        self.book.begin(ctx)
        submit = SubmitRequest(request_id=ctx.context_id, model=ctx.model, sampling=_PREFILL,
                               prompt_token_ids=ctx.prompt_token_ids, salt=msg.salt,
                               reply_to=self.inbox,
                               pin_context=ContextPin(ctx.context_id, ctx.expires_at))
        self.creating[ctx.context_id] = _Creating(msg.request_id, msg.reply_to, submit,
                                                  self.clock() + CREATE_TIMEOUT_S)
        self.dispatch(submit, ctx.prompt_token_ids)

    def _new_context(self, msg: CreateContext) -> Context:
        if not (MIN_TTL_S <= msg.ttl_s <= MAX_TTL_S):
            raise InvalidRequestError(f"ttl_s must be in [{MIN_TTL_S:g}, {MAX_TTL_S:g}]",
                                      "ttl_s")
        model = self.models.name_of(msg.model)
        prompts = self.models.prompts(model)
        text = None
        if msg.messages is not None:
            prompts.check_chars(msg)
            text, guarded = prompts.tokenizer.render(msg.messages, add_generation_prompt=False)
            ids = prompts.tokenizer.encode_rendered(text, guarded)
        else:
            ids = prompts.ids(msg)
        if not ids:
            raise InvalidRequestError("the context has no tokens", "prompt")
        return Context(self.book.new_id(), msg.salt, model, ids, text, msg.messages,
                       time.time() + msg.ttl_s)

    def on_reply(self, msg: RequestDelta | RequestFailed) -> bool:
        """A reply to one of our creation tasks (True), else not ours (False).
        One to a creation an earlier job executor began (it died meanwhile) is
        nobody's: whatever the TE pinned for it is unpinned."""
        if self.turn_pins.on_reply(msg):
            return True
        job = self.creating.get(msg.request_id)
        if job is None:
            orphan = msg.request_id.startswith("ctx-") and msg.request_id not in \
                self.book.contexts
            if orphan and (isinstance(msg, RequestFailed) or msg.finish_reason is not None):
                self.unpin(msg.request_id)
            return False
        if isinstance(msg, RequestDelta):
            if msg.finish_reason is None:
                return True
            ok = msg.finish_reason in ("stop", "length")
            self._end(msg.request_id, ok, "context_failed" if not ok else None,
                      f"the context's prefill ended: {msg.finish_reason}")
            return True
        if msg.error in RETRYABLE_ERRORS and job.attempt + 1 < MAX_ATTEMPTS:
            job.attempt += 1
            log.warning("context %s: %s; creating it again", msg.request_id, msg.error)
            self.dispatch(job.submit, job.submit.prompt_token_ids)
            return True
        self._end(msg.request_id, False, msg.error, msg.message, msg.param)
        return True

    def _end(self, context_id: str, ok: bool, error: str | None, message: str,
             param: str | None = None) -> None:
        job = self.creating.pop(context_id)
        ctx = self.book.finish(context_id, ok)
        if ok and ctx is not None:
            self.reply(job.reply_to, self._info(job.request_id, ctx))
            return
        self.unpin(context_id)  # whatever the TE pinned before it failed
        self._fail(job.request_id, job.reply_to, error or "context_failed", message, param)

    def get(self, msg: GetContext) -> None:
        ctx = self.book.get(msg.context_id, msg.salt)
        if ctx is None:
            return self._not_found(msg)
        self.reply(msg.reply_to, self._info(msg.request_id, ctx))

    def delete(self, msg: DeleteContext) -> None:
        ctx = self.book.delete(msg.context_id, msg.salt)
        if ctx is None:
            return self._not_found(msg)
        self.unpin(ctx.context_id)
        info = self._info(msg.request_id, ctx)
        info.deleted = True
        self.reply(msg.reply_to, info)

    def step(self) -> None:
        """Expiry, and creations that never got an answer."""
        for context_id in self.book.expire():
            self.unpin(context_id)
        now = self.clock()
        for context_id, job in list(self.creating.items()):
            if now > job.deadline:
                self._end(context_id, False, "engine_dead",
                          f"the context was not created within {CREATE_TIMEOUT_S:g} s")

    def _not_found(self, msg) -> None:
        self._fail(msg.request_id, msg.reply_to, "context_not_found",
                   f"No context with id {msg.context_id!r}.", "context_id")

    def _fail(self, request_id: str, reply_to: str, error: str, message: str,
              param: str | None = None) -> None:
        self.reply(reply_to, RequestFailed(request_id=request_id, error=error,
                                           message=message, param=param))

    @staticmethod
    def _info(request_id: str, ctx: Context) -> ContextInfo:
        return ContextInfo(request_id=request_id, context_id=ctx.context_id, model=ctx.model,
                           num_tokens=len(ctx.prompt_token_ids), expires_at=ctx.expires_at,
                           created_at=ctx.created_at)
