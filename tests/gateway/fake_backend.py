"""A fake job executor + TE + cluster manager for gateway tests: one thread
that owns its own sockets.

    gateway PUSH ──SubmitRequest / AbortRequest──> PULL (je_address) ─┐
    gateway PULL <──RequestDelta / RequestFailed── PUSH (to reply_to) ├─ FakeBackend thread
    gateway SUB  <──TEList + TEReport, every publish_interval_s── PUB ─┘ (cm_address)

Scripted generation: one word (= one token) per delta, words drawn from a
PRNG seeded by the request's seed (deterministic) or by a counter; the first
delta carries the prompt's token ids (UTF-8 bytes of the prompt, or the
given ids) and cached_tokens = 8 when the same salt + prompt came before.
Stop strings are cut like the TE does (text before the stop string, held
back while it could still be the start of one; finish "stop"); max_tokens
ends with "length" (unset: model_max_tokens, as a TE resolves it from the
model's max_new_tokens, less a resumed attempt's output). Magic words in the
prompt steer one request: "[script]TEXT" (the output is TEXT, to the end of
the message, 4 characters a delta), "[slow]" (0.2 s per delta), "[hang]" (nothing
after the first delta), "[mute]" (no reply at all), "[invalid]" / "[dead]"
(RequestFailed), "[lose3]" (te_lost after its third delta, as the JE says
when a TE died).

Resumed attempts are served like a TE does: the words of the output ids
already streamed (resumed_output_ids) are re-derived, the PRNG is advanced
past them, and only the text past resumed_text_chars is sent, so a resumed
stream's text equals an uninterrupted one's when the gateway passes the
right counts. Deltas carry their SubmitRequest's attempt.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass, field

import zmq

from deepserve.ipc.sockets import PubSocket, PullSocket, PushSocket
from deepserve.messages.control import TEInfo, TEList, TEReport
from deepserve.messages.engine import AbortRequest, RequestDelta, RequestFailed, SubmitRequest
from deepserve.messages.contexts import (CreateContext, DeleteContext, GetContext, PinTurn,
                                         TurnDone)
from deepserve.messages.scaling import RequestLatencies

_CONTEXT_CALLS = (CreateContext, GetContext, DeleteContext)
_JE_INBOX = (SubmitRequest | AbortRequest | RequestLatencies | TurnDone | PinTurn
             | CreateContext | GetContext | DeleteContext)

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu").split()
TOKEN_BASE = 1000
CACHED_TOKENS = 8
SLOW_DELAY_S = 0.2


def prompt_ids_of(submit: SubmitRequest) -> list[int]:
    if submit.prompt_token_ids is not None:
        return list(submit.prompt_token_ids)
    if submit.messages is not None:
        text = "\n".join(f"{m['role']}: {m['content']}" for m in submit.messages)
        return list(text.encode())
    return list((submit.prompt or "").encode())


@dataclass
class _Job:
    submit: SubmitRequest
    prompt_ids: list[int]
    rng: random.Random
    delay_s: float
    next_at: float
    is_hanging: bool = False
    text: str = ""
    num_sent_chars: int = 0
    num_tokens: int = 0
    is_first: bool = True
    lose_after: int | None = None  # "[lose3]": te_lost after this many tokens
    num_resumed: int = 0  # output tokens a resumed attempt started from
    script: str | None = None  # "[script]TEXT": the output is TEXT, 4 characters a token


def _resume(job: _Job, output_ids: list[int]) -> None:
    """Start where the lost attempt's stream was (as the TE's tokenizer does)."""
    for _ in output_ids:
        job.rng.randrange(len(WORDS))  # the same words as an uninterrupted run
    job.text = " ".join(WORDS[t - TOKEN_BASE] for t in output_ids)
    job.num_tokens = job.num_resumed = len(output_ids)
    job.num_sent_chars = job.submit.resumed_text_chars


@dataclass
class FakeBackend:
    je_address: str
    cm_address: str
    max_prompt_tokens: int = 4000
    model_max_tokens: int = 16
    """max_tokens of a request that leaves it unset (the fake model's max_new_tokens)."""
    delay_s: float = 0.0
    """Seconds between deltas of every request (tests may change it live)."""
    publish_interval_s: float = 0.1
    first_publish_s: float = 0.0
    """Seconds after start before the fake CM's first TE list (a gateway that
    starts before it hears the CM, as one restarted beside a running node)."""
    te_ids: list[str] = field(default_factory=lambda: ["te-0"])
    """TEs the fake CM lists; assign a new list to change what it publishes."""
    max_model_len: int = 0
    """What its TEs announce (TEInfo.max_model_len; 0: unknown)."""
    submits: list[SubmitRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    latencies: list[RequestLatencies] = field(default_factory=list)
    turns_done: list[TurnDone] = field(default_factory=list)
    turns_pinned: list[str] = field(default_factory=list)
    """Sub-requests the gateway said ended in tool calls (PinTurn)."""
    context_calls: list = field(default_factory=list)
    """What the gateway said of finished chat requests (token-id continuity)."""
    """The gateway's SLO samples (TTFT / TPOT per model), as the JE gets them."""
    hold_submits: bool = False
    """Record submits but run none (a JE that took them and has not routed them)."""
    lost: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Request id -> (tokens, characters) it had sent when "[lose3]" failed it."""

    def __post_init__(self):
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._jobs: dict[str, _Job] = {}
        self._seen: set[tuple[str | None, tuple[int, ...]]] = set()
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        self._unseeded = itertools.count(12345)
        self._thread = threading.Thread(target=self._run, name="fake-backend", daemon=True)
        self._restart_je_s: float | None = None
        self._move_to: str | None = None
        self.num_je_restarts = 0

    # -- control from the test thread -------------------------------------------
    def start(self, timeout_s: float = 5.0) -> "FakeBackend":
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("fake backend did not bind its sockets in time")
        if self._error is not None:
            raise RuntimeError("fake backend failed to start") from self._error
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "fake backend thread did not stop"
        if self._error is not None:
            raise RuntimeError("fake backend failed") from self._error

    def wait_for(self, predicate, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.01)
        return predicate()

    def restart_je(self, down_s: float = 0.2, timeout_s: float = 5.0) -> None:
        """Play a JE crash + restart: close the inbox (what was queued in it dies
        with it), rebind after down_s. Running jobs (the TEs' work) go on."""
        before = self.num_je_restarts
        self._restart_je_s = down_s
        assert self.wait_for(lambda: self.num_je_restarts > before, timeout_s)

    def move_je(self, address: str, down_s: float = 0.2, timeout_s: float = 5.0) -> None:
        """Play a head's death and a standby's take-over: the JE inbox closes
        here and binds at `address` (another head's) after down_s."""
        self._move_to = address
        self.restart_je(down_s, timeout_s)

    def submits_for(self, request_id_prefix: str) -> list[SubmitRequest]:
        return [s for s in list(self.submits) if s.request_id.startswith(request_id_prefix)]

    # -- the thread --------------------------------------------------------------
    def _run(self) -> None:
        ctx = zmq.Context()
        socks = []
        try:
            self._inbox = PullSocket(ctx, self.je_address, bind=True,
                                     type=_JE_INBOX)
            self._pub = PubSocket(ctx, self.cm_address)
            self._outboxes: dict[str, PushSocket] = {}
            socks = [self._inbox, self._pub]
            self._ready.set()
            self._loop(ctx)
        except BaseException as exc:  # noqa: BLE001 - reported by start()/stop()
            self._error = exc
            self._ready.set()
        finally:
            inbox = [self._inbox] if socks else []  # the latest one (restart_je)
            for sock in inbox + socks[1:] + list(getattr(self, "_outboxes", {}).values()):
                sock.close()
            ctx.term()

    def _loop(self, ctx: zmq.Context) -> None:
        next_publish = time.monotonic() + self.first_publish_s
        while not self._stop.is_set():
            if self._inbox.poll(0.005):
                self._handle(ctx, self._inbox.get(0))
            self._emit_due()
            if self._restart_je_s is not None:
                self._inbox.close()
                time.sleep(self._restart_je_s)
                self.je_address = self._move_to or self.je_address
                self._inbox = PullSocket(ctx, self.je_address, bind=True,
                                         type=_JE_INBOX)
                self._restart_je_s, self._move_to = None, None
                self.num_je_restarts += 1
            if time.monotonic() >= next_publish:
                self._publish()
                next_publish = time.monotonic() + self.publish_interval_s

    def _handle(self, ctx: zmq.Context, msg) -> None:
        if isinstance(msg, TurnDone):
            self.turns_done.append(msg)
            return
        if isinstance(msg, PinTurn):
            self.turns_pinned.append(msg.request_id)
            return
        if isinstance(msg, _CONTEXT_CALLS):
            self.context_calls.append(msg)  # never answered: a JE that dies with them
            return
        if isinstance(msg, RequestLatencies):
            self.latencies.append(msg)
            return
        if isinstance(msg, AbortRequest):
            self.aborts.append(msg.request_id)
            self._jobs.pop(msg.request_id, None)
            return
        self.submits.append(msg)
        if self.hold_submits:
            return
        if msg.reply_to not in self._outboxes:
            self._outboxes[msg.reply_to] = PushSocket(ctx, msg.reply_to, bind=False)
        prompt_ids = prompt_ids_of(msg)
        failure = self._failure(msg, prompt_ids)
        if failure is not None:
            self._reply(msg, failure)
            return
        text = _magic_text(msg)
        if "[mute]" in text:
            return
        seed = msg.sampling.seed if msg.sampling.seed is not None else next(self._unseeded)
        delay_s = SLOW_DELAY_S if "[slow]" in text else self.delay_s
        job = _Job(msg, prompt_ids, random.Random(seed), delay_s, time.monotonic() + delay_s,
                   "[hang]" in text, lose_after=3 if "[lose3]" in text else None)
        job.script = _script_of(msg)
        if msg.resumed_output_ids:
            _resume(job, prompt_ids[len(prompt_ids) - msg.resumed_output_ids:])
        self._jobs[msg.request_id] = job

    def _failure(self, msg: SubmitRequest, prompt_ids: list[int]) -> RequestFailed | None:
        text = _magic_text(msg)
        if len(prompt_ids) > self.max_prompt_tokens:
            return RequestFailed(request_id=msg.request_id, error="prompt_too_long",
                                 message=f"prompt has {len(prompt_ids)} tokens, more than "
                                         f"{self.max_prompt_tokens}", param="prompt")
        if "[invalid]" in text:
            return RequestFailed(request_id=msg.request_id, error="invalid_request",
                                 message="the TE rejected it", param="stop")
        if "[dead]" in text:
            return RequestFailed(request_id=msg.request_id, error="engine_dead",
                                 message="TE te-0 died")
        return None

    def _emit_due(self) -> None:
        now = time.monotonic()
        for request_id, job in list(self._jobs.items()):
            if job.next_at > now:
                continue
            if job.lose_after is not None and job.num_tokens >= job.lose_after:
                self.lost[request_id] = (job.num_tokens, job.num_sent_chars)
                self._reply(job.submit, RequestFailed(request_id=request_id, error="te_lost",
                                                      message="TE te-0 left the list"))
                del self._jobs[request_id]
                continue
            delta = self._step(job)
            self._reply(job.submit, delta)
            job.next_at = now + job.delay_s
            if delta.finish_reason is not None:
                del self._jobs[request_id]
            elif job.is_hanging:
                job.next_at = float("inf")

    def _max_tokens(self, job: _Job) -> int:
        """As a TE resolves it: unset is the model's max_new_tokens less the
        output a resumed attempt has already."""
        if job.submit.sampling.max_tokens is not None:
            return job.submit.sampling.max_tokens
        return self.model_max_tokens - job.num_resumed

    def _step(self, job: _Job) -> RequestDelta:
        """Generate one token; cut at a stop string like the TE's detokenizer."""
        if job.script is not None:
            return self._scripted(job)
        sampling = job.submit.sampling
        index = job.rng.randrange(len(WORDS))
        token_id = TOKEN_BASE + index
        piece = ("" if job.num_tokens == 0 else " ") + WORDS[index]
        job.text += piece
        job.num_tokens += 1
        finish, visible = None, len(job.text)
        cut = min((i for i in (job.text.find(s) for s in sampling.stop) if i >= 0), default=-1)
        if cut >= 0:
            finish, visible = "stop", cut
        elif job.num_tokens - job.num_resumed >= self._max_tokens(job):
            finish = "length"
        else:
            visible -= _held_back(job.text, sampling.stop)
        delta = RequestDelta(request_id=job.submit.request_id,
                             text=job.text[job.num_sent_chars:visible], token_ids=[token_id],
                             finish_reason=finish, logprobs=_logprobs(token_id, sampling),
                             token_bytes=_token_bytes(token_id, piece, sampling),
                             attempt=job.submit.attempt)
        job.num_sent_chars = max(job.num_sent_chars, visible)
        if job.is_first:
            job.is_first = False
            self._first_delta_fields(job, delta)
        return delta

    def _scripted(self, job: _Job) -> RequestDelta:
        """The next 4 characters of a "[script]" output; "stop" after the last."""
        piece = job.script[job.num_sent_chars:job.num_sent_chars + 4]
        job.num_sent_chars += len(piece)
        job.num_tokens += 1
        finish = "stop" if job.num_sent_chars >= len(job.script) else None
        delta = RequestDelta(request_id=job.submit.request_id, text=piece,
                             token_ids=[TOKEN_BASE], finish_reason=finish,
                             attempt=job.submit.attempt)
        if job.is_first:
            job.is_first = False
            self._first_delta_fields(job, delta)
        return delta

    def _first_delta_fields(self, job: _Job, delta: RequestDelta) -> None:
        key = (job.submit.salt, tuple(job.prompt_ids))
        delta.prompt_token_ids = job.prompt_ids
        delta.cached_tokens = min(CACHED_TOKENS, len(job.prompt_ids)) if key in self._seen else 0
        self._seen.add(key)
        self._num_prompt_tokens += len(job.prompt_ids)
        self._num_cached_tokens += delta.cached_tokens

    def _reply(self, submit: SubmitRequest, msg) -> None:
        try:
            self._outboxes[submit.reply_to].put(msg, timeout=1.0)
        except TimeoutError:
            pass  # the gateway is gone

    def _publish(self) -> None:
        te_ids = list(self.te_ids)
        self._pub.put(TEList(tes=[TEInfo(te_id=t, model="tiny", address=self.je_address,
                                         max_model_len=self.max_model_len) for t in te_ids]))
        for te_id in te_ids:
            self._pub.put(TEReport(te_id=te_id, num_waiting=0, num_running=len(self._jobs),
                                   load_tokens=0, kv_usage=0.25,
                                   num_prompt_tokens=self._num_prompt_tokens,
                                   num_cached_tokens=self._num_cached_tokens))


def _script_of(msg: SubmitRequest) -> str | None:
    """The text after "[script]" in the prompt or the last message, if any."""
    text = msg.prompt if msg.prompt is not None else (
        msg.messages[-1]["content"] if msg.messages else "")
    return text.split("[script]", 1)[1] if "[script]" in text else None


def _magic_text(msg: SubmitRequest) -> str:
    return msg.prompt or str(msg.messages or "")


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that starts some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def _token_bytes(token_id: int, piece: str, sampling) -> dict[int, bytes] | None:
    """As a TE's tokenizer sends them: the sampled token's are the text it
    added; an alternative j's are " " + WORDS[j]."""
    if sampling.logprobs is None:
        return None
    alternatives = {TOKEN_BASE + j: f" {WORDS[j]}".encode() for j in range(sampling.logprobs)}
    return {**alternatives, token_id: piece.encode()}


def _logprobs(token_id: int, sampling) -> list | None:
    if sampling.logprobs is None:
        return None
    top = [(token_id, -0.25)] + [(TOKEN_BASE + j, -1.0 - j) for j in range(sampling.logprobs)]
    return [(token_id, -0.25, top[:sampling.logprobs])]
