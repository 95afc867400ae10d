"""Token-id continuity across turns, and the prompt of a request with a context.

    chat request ──render──> text ──longest earlier turn (or context) it starts with──>
        ids = that turn's exact ids (prompt + reply) + the rest, tokenized alone
    gateway TurnDone(request, output ids) ──> TurnBook: text + reply -> ids, per tenant
    gateway PinTurn(request) ──ended(request)──> (key, turn) for turn_pins.py

Re-tokenizing an agent's turn n+1 does not give back the ids turn n was
served with (the reply's ids were sampled, not tokenized; BPE merges across
the boundary), so without this its KV misses from the first reply token on.
A turn is kept per (tenant, model) only: one tenant's text never selects
another's ids (and the KV it hits is salted by tenant anyway). Memory is
bounded: MAX_TURNS per tenant and MAX_TENANTS tenants (LRU), MAX_PENDING
prompts awaiting their TurnDone (oldest dropped; a failed request's TurnDone
has no reply and an aborted one's AbortRequest drops it), MAX_ENDED ended turns
awaiting a PinTurn. With no earlier turn the ids are exactly those of the
plain tokenization.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from deepserve.control.je.admission import PromptTokens
from deepserve.control.je.contexts import Context
from deepserve.errors import ContextNotFoundError, InvalidRequestError

MAX_TURNS, MAX_TENANTS, MAX_PENDING, MAX_ENDED = 32, 1024, 4096, 1024
PENDING_TTL_S = 3600.0


@dataclass(frozen=True)
class Turn:
    text: str  # rendered prompt + the reply's text (special tokens spelled out)
    ids: list[int]  # the prompt ids + the reply's ids


class TurnBook:
    def __init__(self, enabled: bool = True, clock: Callable[[], float] = time.monotonic):
        self.enabled, self.clock = enabled, clock
        self._turns: OrderedDict[tuple, OrderedDict[str, Turn]] = OrderedDict()
        self._pending: OrderedDict[str, tuple] = OrderedDict()  # id -> (key, text, ids, decode, t)
        self._ended: OrderedDict[str, tuple[tuple, Turn]] = OrderedDict()  # id -> (key, turn)
        self.num_hits = 0

    def note_prompt(self, request_id: str, key: tuple, text: str, ids: list[int],
                    decode: Callable[[list[int]], str]) -> None:
        """A chat request went out with this rendered text and these ids;
        decode(output ids) spells its reply (special tokens included)."""
        if not self.enabled:
            return
        self._pending[request_id] = (key, text, ids, decode, self.clock())
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def on_done(self, request_id: str, output_ids: list[int] | None) -> Turn | None:
        """The request's turn (its prompt noted, output_ids its reply); None, and
        the prompt forgotten, for a request that ended without one (output_ids None)."""
        entry = self._pending.pop(request_id, None)
        if entry is None or output_ids is None or self.clock() - entry[4] > PENDING_TTL_S:
            return None
        key, text, ids, decode, _ = entry
        turn = Turn(text + decode(output_ids), ids + list(output_ids))
        turns = self._turns.setdefault(key, OrderedDict())
        self._turns.move_to_end(key)
        turns[turn.text] = turn
        turns.move_to_end(turn.text)
        while len(turns) > MAX_TURNS:
            turns.popitem(last=False)
        while len(self._turns) > MAX_TENANTS:
            self._turns.popitem(last=False)
        self._ended[request_id] = (key, turn)
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)
        return turn

    def ended(self, request_id: str) -> tuple[tuple, Turn] | None:
        """((salt, model), turn) of a request whose TurnDone came lately; once."""
        return self._ended.pop(request_id, None)

    def longest_prefix(self, key: tuple, text: str) -> Turn | None:
        best = None
        for turn in self._turns.get(key, {}).values():
            if len(turn.text) <= len(text) and text.startswith(turn.text) \
                    and (best is None or len(turn.text) > len(best.text)):
                best = turn
        return best

    def drop(self, request_id: str) -> None:
        """An aborted request: its prompt will not become a turn."""
        self._pending.pop(request_id, None)


def request_ids(msg, model: str, models, contexts, turns: TurnBook) -> list[int]:
    """A SubmitRequest's prompt ids in the job executor: tokenized once,
    continuing an earlier turn of its tenant or its context (models: the
    ModelBook; contexts: the ContextBook); a chat prompt is noted for TurnDone."""
    ctx = None
    if msg.context_id is not None:  # a resumed attempt with its ids has none
        ctx = contexts.get(msg.context_id, msg.salt)
        if ctx is None or ctx.model != model:
            raise ContextNotFoundError(f"No context with id {msg.context_id!r}.", "context_id")
    key = (msg.salt, model)
    prompts = models.prompts(model)
    text, ids = prompt_ids(prompts, msg, turns, key, ctx)
    if text is not None and msg.attempt == 0:
        turns.note_prompt(msg.request_id, key, text, ids,
                          lambda out: prompts.tokenizer.decode(out, False))
    return ids


def prompt_ids(prompts: PromptTokens, msg, turns: TurnBook, key: tuple,
               ctx: Context | None) -> tuple[str | None, list[int]]:
    """(rendered chat text or None, prompt ids) of a SubmitRequest: a context's
    prompt first, continuing the longest earlier turn (or context) it starts
    with; InvalidRequestError naming the field when unusable."""
    if msg.messages is None:  # a completion: the context's ids, then its own
        own = prompts.ids(msg)
        return None, (list(ctx.prompt_token_ids) + own) if ctx is not None else own
    if ctx is not None and not ctx.is_chat:
        raise InvalidRequestError("this context was made from a prompt; use it with "
                                  "/v1/completions", "context_id")
    messages = (ctx.messages + msg.messages) if ctx is not None else msg.messages
    prompts.check_chars(msg if ctx is None else _Sized(messages))
    options = msg.chat.render_options() if getattr(msg, "chat", None) is not None else {}
    return prompts.memo(msg, lambda: _continued(prompts.tokenizer, messages, turns, key, ctx,
                                                options),
                        scope=[*key, options])


def _continued(tokenizer, messages, turns: TurnBook, key: tuple, ctx: Context | None,
               options: dict):
    text, guarded = tokenizer.render(messages, **options)
    candidates = [t for t in (turns.longest_prefix(key, text),) if t is not None]
    if ctx is not None and ctx.text is not None:
        candidates.append(Turn(ctx.text, ctx.prompt_token_ids))
    for turn in sorted(candidates, key=lambda t: len(t.text), reverse=True):
        ids = tokenizer.encode_rendered(text, guarded, (turn.text, turn.ids))
        if ids is not None:
            turns.num_hits += 1
            return text, ids
    return text, tokenizer.encode_rendered(text, guarded)


@dataclass
class _Sized:
    """What PromptTokens.check_chars reads of a request: its messages."""

    messages: list[dict]
    prompt: str | None = None
