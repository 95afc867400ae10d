"""Fork: a model's files pulled from a peer node that holds them, over tcp.

    peer:  WeightServer(ctx, address, dirs)   a thread; ROUTER bound at address
           dirs() -> {model path (the head's name for it): the local directory holding
           its files}: it serves those directories' top-level files and nothing else
    here:  fork_model(ctx, sources, path, dest) -> Forked(source, bytes, seconds)
           asks each source in turn; the first that lists the model sends every
           file in CHUNK_BYTES chunks, WINDOW of them in flight; each chunk's
           crc32 and every file's size are checked; the files land in a hidden
           directory beside `dest`, renamed to `dest` once whole (a reader sees all
           or nothing). A source that stops answering for timeout_s (its host died
           mid-copy) or sends a bad chunk: the copy so far is dropped and the next
           source is asked; none left: ForkError.

Messages: messages/weights.py. With [cluster] secure the sockets run CURVE
like every other tcp:// socket (ipc/curve.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import msgspec
import zmq

from deepserve.cache.weight_cache import model_files
from deepserve.ipc import curve
from deepserve.messages.weights import (FromWeightServer, ToWeightServer, WeightChunk,
                                        WeightFiles, WeightGet, WeightList)

log = logging.getLogger(__name__)
CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 16 << 20
"""The most one WeightGet may ask for (a larger one is refused)."""
WINDOW = 4
"""Chunks in flight per fork: the link stays busy while one is written."""
POLL_S = 0.2


class ForkError(RuntimeError):
    """No source could give the model's files."""


@dataclass(frozen=True)
class Forked:
    source: str
    bytes: int
    seconds: float


class WeightServer:
    """Serves the files of the models dirs() names; stop() ends the thread."""

    def __init__(self, ctx: zmq.Context, address: str, dirs: Callable[[], dict[str, Path]]):
        self.dirs = dirs
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve.secure(self.sock, address, bind=True)
        self.sock.bind(address)
        self.decoder = msgspec.msgpack.Decoder(ToWeightServer)
        self.encoder = msgspec.msgpack.Encoder()
        self.num_served = 0  # bytes sent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.sock.poll(POLL_S * 1000):
                    continue
                frames = self.sock.recv_multipart()
                if len(frames) != 2:
                    continue
                try:
                    msg = self.decoder.decode(frames[1])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                try:
                    reply = self._answer(msg)
                except Exception as e:  # noqa: BLE001 - a file gone mid-read: refused, served on
                    log.warning("weight server: %s refused: %s", msg, e)
                    reply = [self.encoder.encode(WeightChunk(name="", offset=0, error=str(e)))]
                self.sock.send_multipart([frames[0], *reply], copy=False)
        except zmq.ContextTerminated:
            pass
        finally:
            self.sock.close()

    def _answer(self, msg) -> list[bytes]:
        local = self.dirs().get(msg.path)
        try:
            files = {f.name: f for f in model_files(local)} if local is not None else None
        except OSError:
            files = None
        if files is None:
            error = f"model {msg.path!r} is not held here"
            return [self.encoder.encode(WeightFiles(error=error) if isinstance(msg, WeightList)
                                        else WeightChunk(name="", offset=0, error=error))]
        if isinstance(msg, WeightList):
            return [self.encoder.encode(WeightFiles(
                files=[(name, f.stat().st_size) for name, f in sorted(files.items())]))]
        f = files.get(msg.name)
        if f is None or msg.offset < 0 or not 0 < msg.length <= MAX_CHUNK_BYTES:
            return [self.encoder.encode(WeightChunk(name=msg.name, offset=msg.offset,
                                                    error="no such file or range"))]
        with open(f, "rb") as fh:  # read into one buffer that ZeroMQ then sends as it is
            data = bytearray(min(msg.length, max(0, f.stat().st_size - msg.offset)))
            data = memoryview(data)[:os.preadv(fh.fileno(), [data], msg.offset)]
        self.num_served += len(data)
        return [self.encoder.encode(WeightChunk(name=msg.name, offset=msg.offset,
                                                crc=zlib.crc32(data))), data]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def fork_model(ctx: zmq.Context, sources: list[str], path: str, dest: Path,
               timeout_s: float = 10.0, chunk: int = CHUNK_BYTES) -> Forked:
    """Pull model `path`'s files from the first source that gives them all into
    `dest` (created; left as it is if it already exists)."""
    failures = []
    for source in sources:
        started = time.monotonic()
        try:
            nbytes = _pull(ctx, source, path, Path(dest), timeout_s, chunk)
        except (ForkError, OSError) as e:  # OSError: this host's disk or memory is full
            log.warning("fork of %s from %s failed: %s", path, source, e)
            failures.append(f"{source}: {e}")
            continue
        return Forked(source, nbytes, time.monotonic() - started)
    raise ForkError(f"no source gave {path}: {'; '.join(failures) or 'none known'}")


def _pull(ctx: zmq.Context, source: str, path: str, dest: Path, timeout_s: float,
          chunk: int) -> int:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    curve.secure(sock, source, bind=False)
    sock.connect(source)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FromWeightServer)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.part-", dir=dest.parent))
    fds: dict[str, int] = {}

    def receive() -> list:
        if not sock.poll(timeout_s * 1000):
            raise ForkError(f"no answer for {timeout_s:g} s (the peer is gone?)")
        return [f.buffer for f in sock.recv_multipart(copy=False)]  # no copy of a chunk

    try:
        sock.send(encoder.encode(WeightList(path=path)))
        listing = decoder.decode(receive()[0])
        if not isinstance(listing, WeightFiles) or listing.error or not listing.files:
            raise ForkError(getattr(listing, "error", "") or "an empty or bad file list")
        todo = []
        for name, size in listing.files:
            if "/" in name or name in (".", "..") or size < 0:
                raise ForkError(f"a bad file name or size in the list: {name!r} {size}")
            fds[name] = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fds[name], size)
            todo += [(name, off, min(chunk, size - off)) for off in range(0, size, chunk)]
        expected = {(name, off): length for name, off, length in todo}
        pending = iter(todo)
        in_flight = 0
        for name, off, length in pending:  # fill the window
            sock.send(encoder.encode(WeightGet(path=path, name=name, offset=off, length=length)))
            in_flight += 1
            if in_flight == WINDOW:
                break
        total = 0
        while in_flight:
            frames = receive()
            in_flight -= 1
            header = decoder.decode(frames[0])
            if not isinstance(header, WeightChunk) or header.error or len(frames) != 2:
                raise ForkError(getattr(header, "error", "") or "a bad chunk")
            data, want = frames[1], expected.pop((header.name, header.offset), None)
            if want != len(data) or zlib.crc32(data) != header.crc:
                raise ForkError(f"{header.name}@{header.offset}: wrong length or checksum")
            os.pwrite(fds[header.name], data, header.offset)
            total += len(data)
            nxt = next(pending, None)
            if nxt is not None:
                sock.send(encoder.encode(WeightGet(path=path, name=nxt[0], offset=nxt[1],
                                                   length=nxt[2])))
                in_flight += 1
        for fd in fds.values():
            os.close(fd)
        fds.clear()
        try:
            os.rename(tmp, dest)
        except OSError:  # another fork of it finished first
            if not dest.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        return total
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ForkError(f"an undecodable reply: {e}") from None
    finally:
        for fd in fds.values():
            os.close(fd)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        sock.close()
