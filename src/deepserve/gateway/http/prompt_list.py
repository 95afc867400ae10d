"""A completions request with a list of prompts: one ReplyStream per prompt
(each with its n choices), read as one. Choice i of prompt p is index
p * n + i, as vLLM numbers them.

Each stream keeps its own deadline and client checks; the merged stream
reads them concurrently (one task each, into one queue), raises the first
error any of them raises, and closing it closes them all (aborting whatever
has not finished) and stops its readers.
"""

from __future__ import annotations

import asyncio

from deepserve.gateway.link.reply_stream import ReplyStream

MAX_PROMPTS = 64
"""Prompts of one completions request at most."""
_END = object()


class PromptStreams:
    def __init__(self, streams: list[ReplyStream], num_choices: int):
        self.streams, self.num_choices = streams, num_choices
        self._queue: asyncio.Queue = asyncio.Queue()
        self._readers: list[asyncio.Task] = []
        self._num_open = len(streams)

    @property
    def is_disconnected(self):
        return self.streams[0].is_disconnected

    @is_disconnected.setter
    def is_disconnected(self, value) -> None:
        for stream in self.streams:
            stream.is_disconnected = value

    async def wait_started(self) -> None:
        for stream in self.streams:
            await stream.wait_started()

    def close(self) -> None:
        for reader in self._readers:
            reader.cancel()
        for stream in self.streams:
            stream.close()

    def __aiter__(self):
        return self._merged()

    async def _merged(self):
        self._readers = [asyncio.create_task(self._read(p, s))
                         for p, s in enumerate(self.streams)]
        while self._num_open:
            item = await self._queue.get()
            if item is _END:
                self._num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    async def _read(self, prompt: int, stream: ReplyStream) -> None:
        try:
            async for index, delta in stream:
                await self._queue.put((prompt * self.num_choices + index, delta))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            await self._queue.put(exc)
        await self._queue.put(_END)
