"""The one SSE parser (drill/sse.py) the load driver and tools/bench_serve.py share."""

from __future__ import annotations

import asyncio

import httpx

from deepserve.drill.sse import SSEDecoder, aiter_sse_data, sse_data


def test_events_comments_multiline_data_and_an_unclosed_last_event():
    lines = ['data: {"a": 1}', "", ": comment", "", "event: x", "id: 7", "data:x", "data: y",
             "", "", "data:  two spaces", "", "data: [DONE]"]
    assert list(sse_data(lines)) == ['{"a": 1}', "x\ny", " two spaces", "[DONE]"]
    decoder = SSEDecoder()
    assert decoder.feed("data: a") is None and decoder.feed("") == "a"
    assert decoder.feed("") is None and decoder.flush() is None  # no empty events


def _stream(chunks: list[bytes]) -> list[str]:
    async def body():
        for chunk in chunks:
            yield chunk

    async def go() -> list[str]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body()))
        async with httpx.AsyncClient(transport=transport) as client:
            async with client.stream("GET", "http://sse.test/") as response:
                return [data async for data in aiter_sse_data(response)]
    return asyncio.run(go())


def test_chunk_boundaries_and_line_endings_of_a_real_response():
    chunks = [b'data: {"a"', b': 1}\r\n\r\n: comment\n\ndata:x\ndata: y\n', b"\ndata: [DO",
              b"NE]\r\r", b"data: last"]
    assert _stream(chunks) == ['{"a": 1}', "x\ny", "[DONE]", "last"]
