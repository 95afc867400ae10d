"""The streaming path's per-token work: ReplyStream waits for its replies
without polling (one wake-up per reply once nothing asks whether the client
is gone), and each reply's event is JSON whatever its text."""

from __future__ import annotations

import asyncio
import time

from deepserve.gateway.link.reply_stream import DISCONNECT_POLL_S, ReplyStream
from deepserve.messages.engine import RequestDelta


class CountingQueue(asyncio.Queue):
    def __init__(self):
        super().__init__()
        self.num_gets = 0

    async def get(self):
        self.num_gets += 1
        return await super().get()


async def _wait_idle(is_disconnected, idle_s: float) -> tuple[int, tuple]:
    queue = CountingQueue()
    stream = ReplyStream(["r-0"], queue, 60.0, lambda _: None, is_disconnected)
    stream._next_disconnect_check = time.monotonic() - 1.0  # past, as in a long stream
    task = asyncio.create_task(stream._next())
    await asyncio.sleep(idle_s)
    gets_while_idle = queue.num_gets
    queue.put_nowait((0, RequestDelta(request_id="r-0", text="a", token_ids=[1],
                                      finish_reason="stop")))
    return gets_while_idle, await asyncio.wait_for(task, 5)


def test_a_streaming_wait_wakes_once_per_reply_not_every_millisecond():
    gets, (index, delta) = asyncio.run(_wait_idle(None, 0.2))
    assert gets == 1, gets  # the stale check time made it 1 ms waits: ~200 here
    assert (index, delta.text) == (0, "a")


def test_a_wait_that_asks_about_the_client_still_polls_at_its_rate():
    async def present() -> bool:
        return False

    idle_s = 3 * DISCONNECT_POLL_S
    gets, (index, _) = asyncio.run(_wait_idle(present, idle_s))
    assert 2 <= gets <= 6, gets  # a check now, then one per DISCONNECT_POLL_S
    assert index == 0


def test_an_event_is_json_even_with_text_utf8_cannot_carry():
    import json

    from deepserve.gateway.http.generation import _sse

    for text in ("plain", "é ✓ 𝄞", "lone \ud800 surrogate"):
        event = _sse({"error": {"message": text}, "n": -9999.0})
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        assert json.loads(event[6:-2]) == {"error": {"message": text}, "n": -9999.0}
