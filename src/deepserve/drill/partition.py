"""`bin/deepserve-drill partition-head`: two live heads, one term. The link
between the head and its standby is cut while the third node still reaches
both, then heals. Three hosts as network namespaces (drill/netns.py; needs root):

    h0 10.213.77.1  head "head": cluster manager, job executor, gateway; no TE
    h1 10.213.77.2  standby head "h1" (joins h0): its gateway (the load's), h1-te0
    h2 10.213.77.3  node "h2", joined to "h0,h1": h2-te0

Every node runs secure (CURVE with a key set of the drill's own, drill/cluster.py
drill_keys: "head" and "h1" with role head) and the heads share a state_dir,
where terms are claimed (supervisor/head_terms.py).

    cut   a blackhole route on h0 and on h1, each to the other
          h1 hears nothing from h0 for failover_s: head_lost, claims term 2
          (state_dir/terms/2), head_taken_over; h0 sees h1's TE go silent
          (te_removed) and serves on in term 1, until h2's NodeReport says term 2:
          head_stepped_down, and h0's supervisor stops its CM and JE for good
    heal  the routes go; nothing changes hands again

The load: greedy streams through h1's gateway (drill/ns_client.py, run inside h1),
a round before the cut, a round across it, a round after the heal; each is
compared with this process's own greedy run of the same model (a stream with a
wrong, repeated or missing token, or an error, is bad).

Report (JSON): sent, lost (no end), bad_streams, served_twice, delivered_twice,
late_tokens, heads_at_end, proven, proof, taken_over_s, stepped_down_s.
- served_twice: streams that ended more than once, plus requests some TE
  generated on two attempts at once (the gateway got tokens of an attempt it
  had left behind: deepserve_gateway_late_requests_total in h1's /metrics);
  late_tokens is those tokens' count (work done twice, never delivered).
- delivered_twice: the client's side of it alone, streams that ended twice (a
  token delivered twice is a bad stream already).
  A gateway that changes job executor resumes its open streams as new attempts
  (gateway/link/job_client.py) and aborts the old ones at their TEs: tokens the
  old attempt made before the abort landed (in flight, or queued in the
  gateway's inbox) are generated twice and dropped, so served_twice can be
  above 0 while every client got its tokens once.
- heads_at_end: nodes whose last head event is a start or a takeover, not a
  step-down (health logs; h0's first CM start counts as its taking the head).
- proven: both heads saw the cut (h1 head_lost after failover_s of silence;
  h0 te_removed of h1's TE or head_stepped_down) and h1 took term 2 (its
  event, and the claim file naming h1).
ok = nothing lost, no bad stream, none delivered twice, one head at the end, proven;
served_twice is reported (and printed when above 0), not judged.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from deepserve.drill.cluster import drill_keys
from deepserve.drill.health_events import HealthEvents, event_time
from deepserve.drill.netns import HostNet
from deepserve.drill.prompts import greedy_reference

NAME = "partition-head"
DESCRIPTION = ("the link between the head and its standby is cut (3 network namespaces, "
               "root): one head at the end, nothing lost or served twice")
PORT = 7400
URL = "http://127.0.0.1:8000"  # every node's gateway, inside its own host
KEY = "drill-key"
PROMPTS = ("Say hi", "The cluster", "One two three", "Hello there, host")
MAX_TOKENS = 48
FAILOVER_S = 4.0
TE_TIMEOUT_S = 3.0
START_S = 150.0
EVENT_S = 60.0
NODES = ("head", "h1", "h2")
TE = 'type = "colocated"\nmax_num_batched_tokens = 128\nnum_kv_blocks = 128\n' \
     'kv_transfer_backend = "tcp"\n'
"""Each TE: small, KV over DistFlow tcp (the namespaces share /dev/shm)."""


class PartitionDrill:
    """The three hosts and their nodes; `run()` the drill, `close()` always."""

    def __init__(self, model: str, echo: Callable[[str], None]):
        self.model, self.echo = str(Path(model).resolve()), echo
        self.d = Path(tempfile.mkdtemp(prefix="ds-drill-partition-"))
        self.net = HostNet(3)
        self.nodes: dict[str, subprocess.Popen] = {}
        self.state = self.d / "state"
        self.state.mkdir()

    # -- setting up ------------------------------------------------------------

    def start(self) -> None:
        self.net.up()  # NetnsUnavailable: not root, no ip, not permitted
        keys = drill_keys(self.d, True, ["head", "h1"], ["h2"])[1]
        a = self.net.addresses
        common = f'secure = true\nkeys = "{keys}"\nport = {PORT}\n'
        self._node(0, "head", f'host = "{a[0]}"\nname = "head"\nstate_dir = "{self.state}"\n'
                   + common, node=f"te_timeout_s = {TE_TIMEOUT_S}\n")
        self._node(1, "h1", f'host = "{a[1]}"\nname = "h1"\nhead = "{a[0]}:{PORT}"\n'
                   f'standby = true\nfailover_s = {FAILOVER_S}\nstate_dir = "{self.state}"\n'
                   + common, te=True)
        self._node(2, "h2", f'host = "{a[2]}"\nname = "h2"\n'
                   f'head = "{a[0]}:{PORT},{a[1]}:{PORT}"\n' + common, te=True)
        up = self.client(1, "wait", URL, "2", str(START_S), timeout=START_S + 30)
        if up[-1]["num_tes"] != 2:
            raise RuntimeError(f"the cluster did not come up: {up}\n{self.logs()}")

    def _node(self, host: int, name: str, cluster: str, node: str = "",
              te: bool = False) -> None:
        conf = self.d / f"{name}.toml"
        conf.write_text(f'[node]\nmodel = "{self.model}"\nserved_model = "tiny"\n'
                        f'startup_timeout_s = {START_S}\n{node}'
                        f'[gateway]\napi_keys = {{ "{KEY}" = "a" }}\n'
                        f'[supervisor]\nlog_dir = "{self.d / (name + "-logs")}"\n'
                        f'[cluster]\n{cluster}' + (f"[[te]]\n{TE}" if te else ""))
        with open(self.d / f"{name}.out", "wb") as out:
            self.nodes[name] = self.net.run(
                host, [sys.executable, "-m", "deepserve.supervisor", "--conf", str(conf)],
                stdout=out, stderr=subprocess.STDOUT)

    def client(self, host: int, *args: str, timeout: float = 180.0) -> list:
        """drill/ns_client.py inside `host`; its JSON lines."""
        proc = self.net.python(host, "deepserve.drill.ns_client", *args, stdout=subprocess.PIPE,
                               text=True)
        out, _ = proc.communicate(timeout=timeout)
        return [json.loads(line) for line in out.splitlines() if line.strip().startswith(("{", "["))]

    # -- the drill -------------------------------------------------------------

    def run(self, greedy: Callable[[str, int], list[int]]) -> dict:
        counts = Counts(greedy)
        counts.add(self._round(list(PROMPTS)))
        self.echo("warm round done; streaming, then cutting h0 <-/-> h1")
        across = [f"{p} {i}" for i, p in enumerate(PROMPTS * 2)]
        client = self._generate(across)
        cut_at = time.time()
        self._cut()
        proof: list[str] = []
        try:
            lost = self._wait("head_lost", "h1")
            taken = self._wait("head_taken_over", "h1")
            down = self._wait("head_stepped_down", "head")
            self.echo(f"h1 took over at +{event_time(taken) - cut_at:.1f} s, h0 stepped down at "
                      f"+{event_time(down) - cut_at:.1f} s")
            counts.add(self._results(client, across))
        finally:
            self._cut(heal=True)
        proven = self._proof(lost, taken, down, proof)
        time.sleep(FAILOVER_S)  # healed: nothing changes hands again
        counts.add(self._round(list(PROMPTS)))
        late = self._late()
        return {"scenario": NAME, "sent": counts.sent, "lost": counts.lost,
                "bad_streams": len(counts.bad), "served_twice": counts.twice + late[1],
                "delivered_twice": counts.twice, "late_tokens": late[0], "heads_at_end": self._heads_at_end(),
                "proven": proven, "proof": "; ".join(proof),
                "taken_over_s": round(event_time(taken) - cut_at, 2),
                "stepped_down_s": round(event_time(down) - cut_at, 2), "bad": counts.bad}

    def _generate(self, prompts: list[str]) -> subprocess.Popen:
        client = self.net.python(1, "deepserve.drill.ns_client", "generate", URL, KEY, "tiny",
                                 str(MAX_TOKENS), json.dumps(prompts), stdout=subprocess.PIPE,
                                 text=True)
        first = client.stdout.readline()
        if json.loads(first or "{}") != {"event": "streaming"}:
            raise RuntimeError(f"the load did not start: {first!r}\n{self.logs()}")
        return client

    def _results(self, client: subprocess.Popen, prompts: list[str]) -> list:
        line = client.stdout.readline()
        self.net.reap(client, 300)
        results = json.loads(line) if line.strip() else []
        return list(zip(prompts, results + [None] * (len(prompts) - len(results))))

    def _round(self, prompts: list[str]) -> list:
        return self._results(self._generate(prompts), prompts)

    def _cut(self, heal: bool = False) -> None:
        """h0 and h1 stop (or start again) reaching each other; h2 reaches both."""
        for host, other in ((0, 1), (1, 0)):
            proc = self.net.run(host, ["ip", "route", "del" if heal else "add", "blackhole",
                                       f"{self.net.addresses[other]}/32"])
            if self.net.reap(proc, 10) != 0:
                raise RuntimeError(f"could not {'heal' if heal else 'cut'} h{host}'s route")

    def _proof(self, lost: dict, taken: dict, down: dict, proof: list[str]) -> bool:
        silent = lost["details"].get("silent_s", 0)
        claim = self.state / "terms" / "2"
        saw_cut = [e for e in self.health_events("te_removed", "head") if "h1-te0" in json.dumps(e)]
        checks = {
            f"h1 heard nothing from h0 for {silent:.1f} s (head_lost)": silent >= FAILOVER_S,
            "h0 saw h1's TE go silent (te_removed h1-te0)": bool(saw_cut),
            f"h1 took term {taken['details'].get('term')}": taken["details"].get("term") == 2,
            "state_dir/terms/2 names h1": claim.is_file()
            and claim.read_text().startswith(self.net.addresses[1]),
            f"h0 stepped down from term {down['details'].get('term')} to "
            f"{down['details'].get('new_term')}": down["details"].get("new_term") == 2}
        proof.extend(("" if ok else "NOT ") + what for what, ok in checks.items())
        return all(checks.values())

    def _late(self) -> tuple[int, int]:
        """(late tokens, late requests) in h1's gateway's /metrics."""
        proc = self.net.python(1, "deepserve.drill.ns_client", "get", URL, "/metrics", KEY,
                               stdout=subprocess.PIPE, text=True)
        text = proc.communicate(timeout=30)[0]
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("deepserve_gateway_late_tokens_total",
                        "deepserve_gateway_late_requests_total"):
                values[name] = int(float(value))
        if len(values) != 2:
            raise RuntimeError("h1's /metrics has no late-token counters")
        return (values["deepserve_gateway_late_tokens_total"],
                values["deepserve_gateway_late_requests_total"])

    def _heads_at_end(self) -> int:
        """Nodes whose last head event is a start of their CM or a takeover."""
        heads = 0
        for node in NODES:
            last = None
            for e in self.health_events(None, node):
                if e.get("event") in ("head_taken_over", "head_stepped_down") or (
                        e.get("event") == "started" and e.get("component") == "cluster-manager"):
                    last = e["event"]
            heads += last in ("started", "head_taken_over")
        return heads

    # -- looking ---------------------------------------------------------------

    def health_events(self, event: str | None, node: str) -> list[dict]:
        """`event`s (None: all) in `node`'s health log, oldest first."""
        return [e for e in HealthEvents(self.d / f"{node}-logs").events()
                if event is None or e.get("event") == event]

    def _wait(self, event: str, node: str) -> dict:
        deadline = time.monotonic() + EVENT_S
        while not (found := self.health_events(event, node)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {event} in {node}'s health log in {EVENT_S:.0f} s\n"
                                   + self.logs())
            time.sleep(0.2)
        return found[0]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-2500:]
                         for p in sorted(self.d.glob("*.out")))

    def close(self) -> None:
        """SIGTERM every node (each stops its children and cleans up), reap them,
        delete the namespaces and the drill's directory."""
        self.net.stop(list(self.nodes.values()), 30)
        self.net.close()
        shutil.rmtree(self.d, ignore_errors=True)


class Counts:
    """Streams sent, lost, bad (against the greedy reference) and ended twice."""

    def __init__(self, greedy: Callable[[str, int], list[int]]):
        self.greedy = greedy
        self.sent = self.lost = self.twice = 0
        self.bad: dict[str, str] = {}

    def add(self, results: list) -> None:
        for prompt, r in results:
            self.sent += 1
            if r is None:
                self.lost += 1
            elif r["error"] is not None:
                self.bad[prompt] = f"error: {r['error']}"
            elif r["ids"] != self.greedy(prompt, MAX_TOKENS):
                self.bad[prompt] = f"{len(r['ids'])} tokens, not the greedy ones"
            self.twice += r is not None and r.get("finishes", 0) > 1


def ok(report: dict) -> bool:
    return (report["lost"] == 0 and report["bad_streams"] == 0 and report["delivered_twice"] == 0
            and report["heads_at_end"] == 1 and report["proven"])


def run_partition(model: str, echo: Callable[[str], None]) -> dict:
    """The drill on `model` (a model directory): started, run, stopped; its report.
    NetnsUnavailable where namespaces cannot be made; RuntimeError where the
    cluster or an awaited event did not come."""
    from deepserve import LLM
    drill, llm = PartitionDrill(model, echo), None
    try:
        echo(f"starting three hosts (network namespaces {drill.net.tag}-h0..2) and their nodes")
        drill.start()
        llm = LLM(drill.model, num_kv_blocks=256)
        return drill.run(greedy_reference(llm))
    finally:
        if llm is not None:
            llm.shutdown()
        echo("stopping the nodes, deleting the namespaces")
        drill.close()
