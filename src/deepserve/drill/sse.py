"""Server-sent events, the one parser the drill's load driver and tools/ share.

    response.aiter_lines() ──line──> SSEDecoder.feed ──data of each event──> caller

An event is the lines up to a blank line; its `data:` lines are joined by
newlines (one optional space after the colon is dropped). Comments (":"),
`event:`, `id:` and `retry:` carry nothing our clients need and are skipped.
A last event not closed by a blank line still counts (`flush`). Line
splitting (\\n, \\r\\n, \\r) and chunk boundaries are httpx's `aiter_lines`.
"""

from __future__ import annotations

from typing import AsyncIterator, Iterable, Iterator


class SSEDecoder:
    """Lines in (without their line ending), the data of each complete event out."""

    def __init__(self):
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """The event's data when `line` closes one, else None."""
        if line == "":
            return self.flush()
        if line.startswith("data:"):
            self._data.append(line[5:].removeprefix(" "))
        return None

    def flush(self) -> str | None:
        """The pending event's data (the stream ended without a blank line), if any."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The data of each event in `lines`."""
    decoder = SSEDecoder()
    for line in lines:
        if (data := decoder.feed(line)) is not None:
            yield data
    if (data := decoder.flush()) is not None:
        yield data


async def aiter_sse_data(response) -> AsyncIterator[str]:
    """The data of each event of a streaming httpx response."""
    decoder = SSEDecoder()
    async for line in response.aiter_lines():
        if (data := decoder.feed(line)) is not None:
            yield data
    if (data := decoder.flush()) is not None:
        yield data
