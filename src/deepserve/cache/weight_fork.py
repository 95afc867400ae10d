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

Relay (BlitzScale's chain): a node whose fork is under way serves what it
has already received. fork_model(on_partial=...) publishes a Partial (the
listing, the chunks written so far) that the node's WeightServer reads
(`partials`): a WeightList or WeightGet for a chunk not here yet is answered
`retry`, and the asker asks again RETRY_S later. So the CM can chain the
hosts that fork one model at once (each one's first source is the one
before it) and no single source sends the model N times. A relay whose own
source stalls makes no progress: its downstream gives up on it after
timeout_s without a new chunk and asks its next source.

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
from collections import deque
from dataclasses import dataclass, field
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
RETRY_S = 0.02
"""A chunk a relay has not received yet is asked for again this much later."""
FILES_TTL_S = 1.0
"""How long a server trusts its scan of a model's files between listings."""
MAX_FILES = 4096
"""Files one listing may name (a checkpoint has tens; each costs an fd here)."""
MAX_NAME_BYTES = 255
MAX_REQUEST_BYTES = 64 << 10
"""A server's frame cap: a WeightList or WeightGet names a path and a file."""
MAX_REPLY_BYTES = MAX_CHUNK_BYTES + (4 << 20)
"""A fork's frame cap: one chunk, or a listing of MAX_FILES names and sizes."""


class ForkError(RuntimeError):
    """No source could give the model's files."""


@dataclass(frozen=True)
class Forked:
    source: str
    bytes: int
    seconds: float


@dataclass
class Partial:
    """A fork under way, as its node's WeightServer relays it: files None until
    the listing came; `have`: (file name, offset) -> length of the chunks written."""

    tmp: Path | None = None
    files: list[tuple[str, int]] | None = None
    have: dict[tuple[str, int], int] = field(default_factory=dict)


class WeightServer:
    """Serves the files of the models dirs() names, and relays the forks under
    way that partials() names; stop() ends the thread."""

    def __init__(self, ctx: zmq.Context, address: str, dirs: Callable[[], dict[str, Path]],
                 partials: Callable[[], dict[str, Partial]] = dict):
        self.dirs, self.partials = dirs, partials
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        curve.secure(self.sock, address, bind=True)
        self.sock.bind(address)
        self.decoder = msgspec.msgpack.Decoder(ToWeightServer)
        self.encoder = msgspec.msgpack.Encoder()
        self.num_served = 0  # bytes sent
        self.num_relayed = 0  # of which from forks under way
        self._files: dict[str, tuple[float, dict[str, tuple[Path, int]]]] = {}  # _held's
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

    def _answer(self, msg) -> list:
        files = self._held(msg.path, fresh=isinstance(msg, WeightList))
        if files is None:
            partial = self.partials().get(msg.path)
            if partial is not None:
                return self._relay(msg, partial)
            error = f"model {msg.path!r} is not held here"
            return [self.encoder.encode(WeightFiles(error=error) if isinstance(msg, WeightList)
                                        else WeightChunk(name="", offset=0, error=error))]
        if isinstance(msg, WeightList):
            return [self.encoder.encode(WeightFiles(
                files=[(name, size) for name, (_, size) in sorted(files.items())]))]
        entry = files.get(msg.name)
        if entry is None or msg.offset < 0 or not 0 < msg.length <= MAX_CHUNK_BYTES:
            return [self.encoder.encode(WeightChunk(name=msg.name, offset=msg.offset,
                                                    error="no such file or range"))]
        return self._chunk(entry[0], msg.name, msg.offset,
                           min(msg.length, max(0, entry[1] - msg.offset)))

    def _held(self, path: str, fresh: bool) -> dict[str, tuple[Path, int]] | None:
        """Model `path`'s files here: name -> (file, size); None: not held. Looked
        up again on a listing, or once FILES_TTL_S old, so that a chunk costs no
        directory scan; a miss is never remembered (a fork may finish any time)."""
        now = time.monotonic()
        memo = self._files.get(path)
        if memo is not None and not fresh and now - memo[0] <= FILES_TTL_S:
            return memo[1]
        local = self.dirs().get(path)
        try:
            files = {f.name: (f, f.stat().st_size) for f in model_files(local)} \
                if local is not None else None
        except OSError:
            files = None
        if files is None:
            self._files.pop(path, None)
        else:
            self._files[path] = (now, files)
        return files

    def _chunk(self, file: Path, name: str, offset: int, length: int) -> list:
        """One chunk: its header and the bytes, read into one buffer that ZeroMQ
        sends as it is."""
        with open(file, "rb") as fh:
            data = memoryview(bytearray(length))
            data = data[:os.preadv(fh.fileno(), [data], offset)]
        self.num_served += len(data)
        return [self.encoder.encode(WeightChunk(name=name, offset=offset,
                                                crc=zlib.crc32(data))), data]

    def _relay(self, msg, partial: Partial) -> list:
        """A fork under way: its listing, and the chunks already written; `retry`
        for what has not come yet."""
        if isinstance(msg, WeightList):
            files = partial.files
            return [self.encoder.encode(WeightFiles(files=files or [], retry=files is None))]
        length = partial.have.get((msg.name, msg.offset))
        tmp = partial.tmp
        if length is not None and msg.length == length and tmp is not None:
            try:
                reply = self._chunk(tmp / msg.name, msg.name, msg.offset, length)
                self.num_relayed += length
                return reply
            except FileNotFoundError:  # just renamed into place: asked again, found whole
                pass
        return [self.encoder.encode(WeightChunk(name=msg.name, offset=msg.offset, retry=True))]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def fork_model(ctx: zmq.Context, sources: list[str], path: str, dest: Path,
               timeout_s: float = 10.0, chunk: int = CHUNK_BYTES,
               partial: Partial | None = None) -> Forked:
    """Pull model `path`'s files from the first source that gives them all into
    `dest` (created; left as it is if it already exists). partial: filled as the
    copy goes (its listing, each chunk once written), for this node to relay."""
    failures = []
    for source in sources:
        started = time.monotonic()
        try:
            nbytes = _pull(ctx, source, path, Path(dest), timeout_s, chunk,
                           partial if partial is not None else Partial())
        except (ForkError, OSError) as e:  # OSError: this host's disk or memory is full
            log.warning("fork of %s from %s failed: %s", path, source, e)
            failures.append(f"{source}: {e}")
            continue
        return Forked(source, nbytes, time.monotonic() - started)
    raise ForkError(f"no source gave {path}: {'; '.join(failures) or 'none known'}")


def _pull(ctx: zmq.Context, source: str, path: str, dest: Path, timeout_s: float,
          chunk: int, partial: Partial) -> int:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    curve.secure(sock, source, bind=False)
    sock.connect(source)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FromWeightServer)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.part-", dir=dest.parent))
    fds: dict[str, int] = {}
    last = time.monotonic()  # the last progress: a listing, or a chunk written

    def receive() -> list:
        if time.monotonic() - last > timeout_s or not sock.poll(timeout_s * 1000):
            raise ForkError(f"no progress for {timeout_s:g} s (the peer, or its own "
                            "source, is gone?)")
        return [f.buffer for f in sock.recv_multipart(copy=False)]  # no copy of a chunk

    try:
        while True:  # a relay that has no listing yet says retry
            sock.send(encoder.encode(WeightList(path=path)))
            listing = decoder.decode(receive()[0])
            if not isinstance(listing, WeightFiles) or not listing.retry:
                break
            time.sleep(RETRY_S)
        if not isinstance(listing, WeightFiles) or listing.error or not listing.files:
            raise ForkError(getattr(listing, "error", "") or "an empty or bad file list")
        last = time.monotonic()
        _check_listing(listing.files, tmp)
        todo: deque = deque()
        for name, size in listing.files:
            fds[name] = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fds[name], size)
            todo.extend((name, off, min(chunk, size - off)) for off in range(0, size, chunk))
        partial.tmp, partial.files = tmp, list(listing.files)
        expected = {(name, off): length for name, off, length in todo}
        later: deque = deque()  # (when, request): chunks a relay did not have yet
        in_flight = total = 0
        while todo or later or in_flight:
            now = time.monotonic()
            while in_flight < WINDOW and (todo or later and later[0][0] <= now):
                name, off, length = later.popleft()[1] if later and later[0][0] <= now \
                    else todo.popleft()
                sock.send(encoder.encode(WeightGet(path=path, name=name, offset=off,
                                                   length=length)))
                in_flight += 1
            if not in_flight:
                time.sleep(RETRY_S)
                continue
            frames = receive()
            in_flight -= 1
            header = decoder.decode(frames[0])
            if isinstance(header, WeightChunk) and header.retry:
                key = (header.name, header.offset)
                if key in expected:
                    later.append((time.monotonic() + RETRY_S, (*key, expected[key])))
                continue
            if not isinstance(header, WeightChunk) or header.error or len(frames) != 2:
                raise ForkError(getattr(header, "error", "") or "a bad chunk")
            data, want = frames[1], expected.pop((header.name, header.offset), None)
            if want != len(data) or zlib.crc32(data) != header.crc:
                raise ForkError(f"{header.name}@{header.offset}: wrong length or checksum")
            os.pwrite(fds[header.name], data, header.offset)
            partial.have[(header.name, header.offset)] = want
            total += len(data)
            last = time.monotonic()
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
        partial.tmp, partial.files = None, None
        partial.have.clear()
        for fd in fds.values():
            os.close(fd)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        sock.close()


def _check_listing(files: list[tuple[str, int]], into: Path) -> None:
    """ForkError unless the peer's listing is one a model could be: at most
    MAX_FILES plain names, each once, and sizes that fit the free space here
    (the copy is laid out from them before a byte arrives: a listing of
    petabytes took this node's disk, and its chunk plan its memory)."""
    if len(files) > MAX_FILES:
        raise ForkError(f"the list names {len(files)} files; at most {MAX_FILES}")
    names = [name for name, _ in files]
    if len(set(names)) != len(names):
        raise ForkError("the list names a file twice")
    for name, size in files:
        if not name or "/" in name or "\x00" in name or name in (".", "..") \
                or len(name.encode()) > MAX_NAME_BYTES or size < 0:
            raise ForkError(f"a bad file name or size in the list: {name[:80]!r} {size}")
    total, free = sum(size for _, size in files), shutil.disk_usage(into).free
    if total > free:
        raise ForkError(f"the list's files hold {total} bytes; {free} are free here")
