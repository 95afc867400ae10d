"""Turn pins: an agent's KV kept in host memory while it runs its tools.

    gateway ──TurnDone──> TurnBook (turns.py): the turn's ids (prompt + reply)
    gateway ──PinTurn(request id)──> pin(key, turn) ──dispatch(SubmitRequest: the turn's
        ids but the last, max_tokens 1, ContextPin(on_host, expires_at = now + ttl_s),
        reply_to = the JE)──> a TE (routed by prefix locality: a cache hit, not a prefill)
        ──its blocks held in the host tier (tiers/host_pins.py) until expires_at──> its
        last RequestDelta / RequestFailed ──on_reply──> counted, nothing more

A reply that ends in tool calls is followed, seconds later, by the same
conversation with the tools' results appended. Meanwhile other requests push
its blocks out of the device pool and, under load, out of the LRU host tier:
the continuing turn then prefills its whole history again. The pin is a
hint, never a promise: past the tier's budget, on a TE that died, or with
no host tier, the turn is cached like any other and nothing fails. The tier
service ends each pin at its expires_at by itself, so one this JE began
before it died ends too. The last id is left out: its KV was never computed
(a sampled token is not fed back), and the ids may fill max_model_len.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict

from deepserve.control.je.turns import Turn
from deepserve.messages.cache import ContextPin
from deepserve.messages.engine import RequestDelta, RequestFailed, SubmitRequest
from deepserve.messages.sampling import SamplingParams

PREFIX = "turn-"
MAX_PENDING = 1024
_PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class TurnPins:
    def __init__(self, ttl_s: float, inbox: str, dispatch):
        """ttl_s: [node] tool_call_pin_s (0: off); dispatch(SubmitRequest, ids):
        route and send a task, as for contexts."""
        self.ttl_s, self.inbox, self.dispatch = ttl_s, inbox, dispatch
        self.pending: OrderedDict[str, None] = OrderedDict()  # pin ids asked, oldest first
        self.num_asked = self.num_pinned = self.num_failed = 0

    def pin(self, ended: tuple[tuple, Turn] | None) -> None:
        """ended: TurnBook.ended() of the request: ((salt, model), turn)."""
        if self.ttl_s <= 0 or ended is None or len(ended[1].ids) < 2:
            return
        (salt, model), turn = ended
        pin_id = f"{PREFIX}{uuid.uuid4().hex}"
        ids = list(turn.ids[:-1])
        self.pending[pin_id] = None
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)
        self.num_asked += 1
        self.dispatch(SubmitRequest(
            request_id=pin_id, model=model, sampling=_PREFILL, prompt_token_ids=ids,
            salt=salt, reply_to=self.inbox,
            pin_context=ContextPin(pin_id, time.time() + self.ttl_s, on_host=True)), ids)

    def on_reply(self, msg: RequestDelta | RequestFailed) -> bool:
        """A reply to one of our pins (True: taken), else not ours."""
        if not msg.request_id.startswith(PREFIX):
            return False
        if isinstance(msg, RequestDelta) and msg.finish_reason is None:
            return True
        if msg.request_id in self.pending:
            del self.pending[msg.request_id]
            if isinstance(msg, RequestFailed) or msg.finish_reason not in ("stop", "length"):
                self.num_failed += 1
            else:
                self.num_pinned += 1
        return True
