"""Which hops and source files one chat request passes through, in order, and
in which processes: `python tools/trace_request.py [--conf conf/node.toml]`;
`--path` prints the expected hops only, starting nothing.

Starts a node whose every process (they inherit PYTHONPATH) loads a
sitecustomize that records, per process, the times at which functions of
each deepserve source file are called (sys.setprofile, 'call' events only,
flushed to a file every 0.2 s, since forked children leave by os._exit).
Then it waits for the node to be idle, sends one streamed chat completion, and
reports the files with a function called during the request that was not
called during an idle window just before it (heartbeats, TE-list pushes and
other background loops), ordered by that first call inside the request.
A process hop is a change of process between consecutive files of that
order.

First it prints the request's path as docs/architecture.md draws it (both
read HOPS from tools/architecture.py): per hop its message type, the sending
and receiving files, the socket kinds, and when and in which process the
hop's `seen` function was first called during the request ("not seen" if
never: the code moved, or the request took another path).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is no package
from architecture import HOPS, Hop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SITE = '''
import os, sys, threading, time
_out = os.environ["DEEPSERVE_TRACE_DIR"]
_calls = {}
_last = [0.0]
def _flush():
    path = os.path.join(_out, f"{os.getpid()}.json")
    import json
    mp = sys.modules.get("multiprocessing")  # a forked child's name (deepserve-master)
    name = mp.current_process().name if mp is not None else ""
    with open(path + ".tmp", "w") as f:
        json.dump({"argv": sys.argv, "name": name, "calls": _calls}, f)
    os.replace(path + ".tmp", path)
def _prof(frame, event, arg):
    if event != "call":
        return
    name = frame.f_code.co_filename
    if "/deepserve/" not in name or "/src/" not in name:
        return
    now = time.time()
    key = name.split("/src/", 1)[1] + ":" + frame.f_code.co_qualname
    times = _calls.setdefault(key, [])
    if len(times) < 2000:
        times.append(now)
    if now - _last[0] > 0.2:
        _last[0] = now
        try:
            _flush()
        except Exception:
            pass
sys.setprofile(_prof)
threading.setprofile(_prof)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conf", default=str(ROOT / "conf" / "node.toml"))
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--path", action="store_true",
                    help="print the expected hops (docs/architecture.md) and start nothing")
    args = ap.parse_args()
    if args.path:
        print("\n".join(hop_line(n, hop) for n, hop in enumerate(HOPS, 1)))
        return
    work = Path(tempfile.mkdtemp(prefix="ds-trace-"))
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITE)
    (work / "out").mkdir()
    env = {**os.environ, "DEEPSERVE_TRACE_DIR": str(work / "out"),
           "PYTHONPATH": f"{work / 'site'}:{os.environ.get('PYTHONPATH', '')}"}
    node = subprocess.Popen([sys.executable, "-m", "deepserve.supervisor", "--conf", args.conf,
                             "--port", str(args.port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{args.port}"
    try:
        _wait_healthy(url, node)
        time.sleep(args.idle_s)  # let warm-up traffic settle
        idle = (time.time() - args.idle_s, time.time())
        t0 = time.time()
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
                "model": _model(url), "max_tokens": 8, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": "Hello there"}]}) as r:
            r.raise_for_status()
            for _ in r.iter_lines():  # the SSE chunks, up to data: [DONE]
                pass
        t1 = time.time()
        time.sleep(0.6)  # last flushes
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(30)
    _report(work / "out", idle, (t0, t1))


def _wait_healthy(url: str, node: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.poll() is not None:
            raise SystemExit(f"node exited: {node.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("num_tes", 0) > 0:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit("node not healthy")


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]


def _process_name(argv: list[str], name: str = "") -> str:
    if name.startswith("deepserve-"):  # a TE child forked by multiprocessing
        return name.removeprefix("deepserve-")
    text = " ".join(argv)
    for key in ("--role", "--te-id", "-m"):
        if key in argv:
            return argv[argv.index(key) + 1].rsplit(".", 1)[-1]
    return text[:40] or "forked"


def hop_line(n: int, hop: Hop) -> str:
    """One hop as docs/architecture.md names it: message, files, sockets."""
    sender = f"{hop.sender} ({hop.sender_file})" if hop.sender_file else hop.sender
    receiver = f"{hop.receiver} ({hop.receiver_file})" if hop.receiver_file else hop.receiver
    return f"{n:2d}. {hop.message:26s} {sender} -> {receiver}  over {hop.transport}"


def _load(out: Path) -> dict[str, dict]:
    """Process label -> its dump (argv, name, calls: 'file:qualname' -> times)."""
    dumps = {}
    for dump in sorted(out.glob("*.json")):
        data = json.loads(dump.read_text())
        dumps[f"{_process_name(data['argv'], data.get('name', ''))}[{dump.stem}]"] = data
    return dumps


def hop_report(dumps: dict[str, dict], window: tuple[float, float]) -> list[str]:
    """Per hop: its line, and the first call of its `seen` function inside
    the request's window (in which process), or "not seen"."""
    lines = []
    for n, hop in enumerate(HOPS, 1):
        key = f"deepserve/{hop.seen}"
        first = min(((t, proc) for proc, data in dumps.items()
                     for t in data["calls"].get(key, []) if window[0] <= t <= window[1]),
                    default=None)
        where = (f"{(first[0] - window[0]) * 1000:8.1f} ms  {first[1]}" if first
                 else "     not seen")
        lines.append(f"{where:30s} {hop_line(n, hop)}")
    return lines


def _report(out: Path, idle: tuple[float, float], window: tuple[float, float]) -> None:
    dumps = _load(out)
    print("hops (docs/architecture.md), first seen in the request:")
    print("\n".join(hop_report(dumps, window)))
    print("\nfiles in first-call order:")
    path: list[tuple[float, str, str]] = []
    for proc, data in dumps.items():
        first: dict[str, float] = {}  # file -> first call, in the request, of a
        for key, times in data["calls"].items():  # function the idle window never called
            busy = [t for t in times if window[0] <= t <= window[1]]
            if busy and not any(idle[0] <= t <= idle[1] for t in times):
                name = key.split(":", 1)[0]
                first[name] = min(first.get(name, busy[0]), min(busy))
        path += [(t, proc, name) for name, t in first.items()]
    path.sort()
    hops, last = 0, None
    for t, proc, name in path:
        hops += last is not None and proc != last
        last = proc
        print(f"{(t - window[0]) * 1000:8.1f} ms  {proc:32s} {name}")
    files = {name for _, _, name in path}
    print(f"\n{len(files)} files, {len({p for _, p, _ in path})} processes, "
          f"{hops} changes of process in first-call order; request took "
          f"{(window[1] - window[0]) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
