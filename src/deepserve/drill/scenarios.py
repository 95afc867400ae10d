"""Drill scenarios: which component of which TE gets which fault, what counts
as the supervisor noticing it, what proves the fault happened, and what
counts as recovered. Pure data and lookups; applying a fault is injection.py,
proving it proof.py.

    scenario          target            fault (how)                         deadline_s
    kill-worker       te0/worker0       SIGKILL (pid from the health log)   heartbeat_deadline_s
    kill-master       te0/master        SIGKILL                             heartbeat_deadline_s
    kill-tokenizer    te0/tokenizer     SIGKILL                             heartbeat_deadline_s
    hang-worker       te0/worker0       SIGSTOP (heartbeats stop too)       heartbeat_deadline_s
    stall-worker      te0/worker0       hook file te0.worker0.stall         progress_deadline_s
    slow-worker       te0/worker0       hook file te0.worker0.slow ("0.05") progress_deadline_s
    drop-cache        teN/master, every hook file teN.master.drop-cache     -
                      TE of te0's type
    kv-transfer-fail  <prefill>/worker0 hook file <prefill>.worker0.kv-fail -
    poison            teN/worker0,      hook file teN.worker0.poison        -
                      every TE of       (the marker's token ids), then one
                      te0's type        request ending in them (poison.py)
    kill-cm           cluster-manager   SIGKILL (node process)              heartbeat_deadline_s
    kill-je           job-executor      SIGKILL (node process)              heartbeat_deadline_s
    kill-gateway      gateway           SIGKILL (node process)              heartbeat_deadline_s
    kill-kv-tier      kv-cache          SIGKILL (node process; the node it  heartbeat_deadline_s
                                        starts gets a 16 MiB host tier)
    disk-full         kv-cache          hook file kv-cache.disk-full for 8 s -
                                        (every disk write fails, ENOSPC), then one fresh
                                        prompt so that a block is written (needs a disk tier)
    corrupt-disk      the disk tier     one payload byte flipped in every   -
                                        block file under [node] disk_cache_dir (after
                                        one fresh prompt, so that there is one)
    dualpath-de-fail  <decode>/worker0  hook file <decode>.worker0.stage-die heartbeat_deadline_s
                      (conf/dualpath.toml; the worker exits 13 half-way through
                      staging a prompt's storage blocks for its prefill TE)
    kill-head         the head host     SIGKILL it whole; a standby head     [cluster] failover_s
                                        takes over (drill/cluster.py: HeadCluster)
    kill-node         node n2 (a host)  SIGKILL the node process and every   [node] te_timeout_s
                      of its cluster    process under it (drill/cluster.py: a head and two
                                        joined nodes on 127.0.0.1-3, conf/cluster-*.toml)

    scale-across      the joined node   as kill-node, on a cluster whose     [node] te_timeout_s
                      the model's first head has no devices and one [[model]] at zero
                      TE was placed on  (conf/cluster-scaled-*.toml): the first requests
                                        start its TE on a joined node; that node is killed

kill-node loses a whole host: its TEs leave the head's TE list once silent
for te_timeout_s (detection: the cluster manager's `te_removed` events for
all of them), their requests resume on the other node, nothing restarts
(the host is gone). Proof: every killed pid is gone and each of the node's
TEs was removed. Recovery: a request that started after the detection completed.

kill-head loses the head host: the head (cluster manager, job executor,
gateway; no TE) runs as a process on 127.0.0.1 and the drill's own node is a
standby head on 127.0.0.2 (its gateway takes the load) with n2 on 127.0.0.3
joined to both (drill/cluster.py: HeadCluster). Detection: the standby's
`head_lost` (the head's CM silent for failover_s); proof: every killed pid
gone and the standby's `head_taken_over` (it started the CM and JE);
recovery: a request that started after the detection completed. The report
adds no_service_s: from the kill to the first completion of a request sent
after it (the window with no service).

scale-across is the serverless case of it: the killed node ran the only TE
of a model the head's autoscaler placed there (the drill finds the node in
the head's `scale_decision`, which names where it placed). Detection: the
TE's `te_removed`; proof: the node's pids gone, its TE removed and the CM's
`node_lost` for that node; recovery: a request that started after the
detection completed, which needs the model's TE started on the other node.

disk-full and corrupt-disk hit the disk tier (a node with [node]
disk_cache_dir; the node the drill starts gets one in its run directory).
disk-full is detected by the tier service's `cache_tier_disabled` and
recovered at its `cache_tier_enabled` (a probe write went through after the
hook was lifted); corrupt-disk is detected by the first `cache_block_corrupt`
(the tier service's scrub, or a TE that read one first) and recovered at the
first request that completed after it: the corrupt blocks were recomputed,
never served (the load's tokens equal the reference).

kill-cm / kill-je / kill-kv-tier / kill-gateway hit a node-level process
(node_process: the target is the process itself, not a part of a TE).
Detection is its "crashed" event; recovery is the replacement's
recovered_event: the new CM's first complete TE list (te_list_complete), the
new JE's or tier service's "started" (the tier service comes back empty: what
it held is recomputed); for the gateway a request started after the
detection that completed (served_again). The gateway's open requests end
with a connection error the client sees (they are the load's failures, not
lost), as do those sent until it listens again. The verdict that matters is the
load's: lost = 0 and bad_streams = 0 (issue 11: control-plane restarts lose
nothing).

deadline_s is the supervisor deadline that bounds detection: a dead or
SIGSTOPped process sends no heartbeat, so it is found within the heartbeat
deadline at the latest (a crash is usually seen sooner, by the pid probe); an
in-loop stall keeps heartbeating and is found by the progress deadline. For
slow-worker it is the deadline the slowed worker must stay clear of (the
supervisor should *not* act: detect_s is normally None). drop-cache and
kv-transfer-fail are not the supervisor's business (no deadline).

Proof that the fault took effect (a drill without it fails, proof.py):
  signals     the signal reached a pid the health log named, and a "crashed",
              "hung" or "heartbeat_missed" event for that very pid followed
              (or the TE host's "crashed" once that pid was gone)
  hooks       the target's own `fault_injected` event (faults.py -> ActorLife
              -> heartbeat channel -> supervisor -> health.jsonl)
  drop-cache  + a probe prompt cached before the drop is not cached right after
  kv-fail     + a `request_migrated` event after the fault, and that request
              completed (the decode side failed it as kv_transfer_failed, the
              gateway resumed it)
  poison      + exactly one `request_quarantined` event after the fault, and
              the poison request failed as request_crashed_engine (poison.py;
              its recovery and restart count are there too)
  stage-die   + a "crashed" event of the decode TE after the fault (it died of it)
  disk-full   + a `cache_tier_disabled` event after a fresh prompt's block was written
  corrupt     at least one block file corrupted, and a `cache_block_corrupt` event after it

Detection (restarting scenarios): the first "crashed", "killed", "hung" or
"heartbeat_missed" event of the target TE (component "teN" or "teN/...")
after the fault. Recovery: the TE's "recovered" event after the fault (the
replacement served its warm-up request and is back in the TE list). The other
scenarios report as detection only such an event if one happens, and recover
at the first completed request that started after the fault
(stream.first_success_after).

Fault files (only honoured when the node runs with [supervisor] drill = true):
`<drill_dir>/<component with "/" -> ".">.<fault>`. The drill removes every
file it made at cleanup (stall, stage-die: as soon as the fault is detected,
so the replacement worker does not do it again), and SIGKILLs a process it SIGSTOPped
if, at the end, that very pid still exists and is still stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

DETECT_EVENTS = frozenset({"crashed", "killed", "hung", "heartbeat_missed"})
RECOVERED = "recovered"
HEARTBEAT, PROGRESS, TE_TIMEOUT, FAILOVER = "heartbeat", "progress", "te_timeout", "failover"
NODE_KILL = "node-kill"
TE_REMOVED = "te_removed"


@dataclass(frozen=True)
class Scenario:
    name: str
    part: str
    """The component inside the TE: worker0, master, tokenizer."""
    fault: str
    """SIGKILL / SIGSTOP (signals to the part's pid) or a hook: stall, slow, drop-cache, kv-fail."""
    deadline: str | None
    """Which supervisor deadline applies: HEARTBEAT, PROGRESS or None."""
    restarts: bool
    """The supervisor is expected to replace the TE: detection + "recovered" event."""
    te_type: str | None = None
    """Target the first TE of this type (kv-transfer-fail: prefill) instead of te0."""
    hook_content: str = ""
    hold_s: float = 0.0
    """Hook faults the drill lifts itself (slow): seconds before the file is removed."""
    every_te_of_type: bool = False
    """Inject into the part of every TE of the target's type (drop-cache: so the
    cache probe cannot land on a TE that kept its cache)."""
    description: str = ""
    node_process: bool = False
    """part is a node-level process (cluster-manager, job-executor), not a TE's."""
    recovered_event: str = RECOVERED
    """The health event (of the target) that says the replacement is back."""
    conf: str = "drill.toml"
    """The conf/ file a drill that starts its own node takes (--conf overrides)."""
    node_overrides: tuple[tuple[str, object], ...] = ()
    """[node] keys set on a node the drill starts itself (never on --url's)."""
    prompt_tokens: int = 0
    """Long load prompts of this many tokens, each its own (0: the usual mix)."""
    served_again: bool = False
    """Recovered once a request that started after the detection completed (the
    gateway: its process started is not yet a port that serves)."""
    detect_events: frozenset[str] = DETECT_EVENTS
    """The health events that count as the fault seen (of the target; see detect_anywhere)."""
    detect_anywhere: bool = False
    """A detection event of any component counts (corrupt-disk: a TE may find it first)."""
    needs_disk: bool = False
    """Runs only against a node with a disk tier ([node] disk_cache_dir)."""
    node_conf: str = "cluster-node.toml"
    """The conf/ file the joined nodes of a node-killing drill take (--node-conf overrides)."""
    scales_across: bool = False
    """The node killed is the one the head placed the model's first TE on (scale-across)."""
    kills_head: bool = False
    """The node killed is the head; the load goes through a standby head's gateway
    (drill/cluster.py: HeadCluster)."""

    @property
    def kills_node(self) -> bool:
        """The fault is a whole node (drill/cluster.py), not one TE's process."""
        return self.fault == NODE_KILL

    @property
    def is_signal(self) -> bool:
        return self.fault in ("SIGKILL", "SIGSTOP")


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("kill-worker", "worker0", "SIGKILL", HEARTBEAT, True,
             description="SIGKILL the TE's worker process"),
    Scenario("kill-master", "master", "SIGKILL", HEARTBEAT, True,
             description="SIGKILL the TE's master process"),
    Scenario("kill-tokenizer", "tokenizer", "SIGKILL", HEARTBEAT, True,
             description="SIGKILL the TE's tokenizer process"),
    Scenario("hang-worker", "worker0", "SIGSTOP", HEARTBEAT, True,
             description="SIGSTOP the TE's worker (no progress, no heartbeats)"),
    Scenario("stall-worker", "worker0", "stall", PROGRESS, True,
             description="the worker stops making progress but keeps heartbeating"),
    Scenario("slow-worker", "worker0", "slow", PROGRESS, False, hook_content="0.05", hold_s=3.0,
             description="every worker step 50 ms slower for 3 s (must not count as hung)"),
    Scenario("drop-cache", "master", "drop-cache", None, False, every_te_of_type=True,
             description="every master of the target TE's type wipes its prefix cache once"),
    Scenario("kv-transfer-fail", "worker0", "kv-fail", None, False, te_type="prefill",
             description="the prefill TE's next KV transfer fails mid-way"),
    Scenario("poison", "worker0", "poison", None, False, every_te_of_type=True,
             description="one request of death under load (every worker of the type exits "
                         "on its marker): quarantined, at most the TEs it crashed restart"),
    Scenario("kill-cm", "cluster-manager", "SIGKILL", HEARTBEAT, True, node_process=True,
             recovered_event="te_list_complete",
             description="SIGKILL the cluster manager under load (in-flight streams go on)"),
    Scenario("kill-je", "job-executor", "SIGKILL", HEARTBEAT, True, node_process=True,
             recovered_event="started",
             description="SIGKILL the job executor under load (nothing hangs or is refused)"),
    Scenario("kill-gateway", "gateway", "SIGKILL", HEARTBEAT, True, node_process=True,
             served_again=True,
             description="SIGKILL the gateway under load (its open requests end with a "
                         "connection error the client sees; the next ones are served)"),
    Scenario("kill-kv-tier", "kv-cache", "SIGKILL", HEARTBEAT, True, node_process=True,
             recovered_event="started", node_overrides=(("host_cache_bytes", 16 << 20),),
             description="SIGKILL the node's KV tier service under load (its blocks are "
                         "recomputed; nothing fails)"),
    Scenario("disk-full", "kv-cache", "disk-full", None, False, node_process=True, hold_s=8.0,
             detect_events=frozenset({"cache_tier_disabled"}),
             recovered_event="cache_tier_enabled", needs_disk=True,
             description="the disk tier's disk is full for 8 s: the tier turns off, serving "
                         "goes on from host, and the tier comes back once the disk has room"),
    Scenario("corrupt-disk", "kv-cache", "corrupt", None, False, node_process=True,
             detect_events=frozenset({"cache_block_corrupt"}), detect_anywhere=True,
             served_again=True, needs_disk=True,
             description="a byte flipped in every block file of the disk tier: each is "
                         "found (scrub or read) and recomputed, never served"),
    Scenario("dualpath-de-fail", "worker0", "stage-die", HEARTBEAT, True, te_type="decode",
             conf="dualpath.toml", node_overrides=(("host_cache_bytes", 1 << 20),),
             prompt_tokens=640,
             description="a decode TE dies while it reads storage for its prefill TE "
                         "(DualPath): its requests complete elsewhere"),
    Scenario("kill-node", "n2", NODE_KILL, TE_TIMEOUT, False, conf="cluster-head.toml",
             description="a joined node (a host) dies whole under load: its TEs leave the "
                         "list, their requests resume on the other node"),
    Scenario("kill-head", "head", NODE_KILL, FAILOVER, False, conf="cluster-head.toml",
             kills_head=True,
             description="the head host (cluster manager, job executor, gateway) dies whole "
                         "under load: a standby head takes over, its gateway's requests end"),
    Scenario("scale-across", "", NODE_KILL, TE_TIMEOUT, False, conf="cluster-scaled-head.toml",
             node_conf="cluster-scaled-node.toml", scales_across=True,
             description="a model at zero starts on a joined node (the head has no devices), "
                         "which dies under load: its TE starts on the other node, nothing lost"),
)}

ALIASES = {"hang-worker-sigstop": "hang-worker", "hang-worker-stall": "stall-worker"}


def get_scenario(name: str, mode: str | None = None) -> Scenario:
    """By name; hang-worker takes a mode: "sigstop" (default) or "stall"."""
    name = ALIASES.get(name, name)
    if mode is not None:
        if name not in ("hang-worker", "stall-worker"):
            raise ValueError(f"--mode applies to hang-worker only, not {name}")
        if mode not in ("sigstop", "stall"):
            raise ValueError(f"unknown hang mode {mode!r}: sigstop or stall")
        name = "hang-worker" if mode == "sigstop" else "stall-worker"
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


def deadline_of(scenario: Scenario, supervisor, te_timeout_s: float = 10.0,
                failover_s: float = 4.0) -> float | None:
    """The configured deadline (seconds) that applies to `scenario`;
    `supervisor` is NodeConfig.supervisor (or None: the defaults 3 / 5 s);
    te_timeout_s: [node] te_timeout_s (kill-node); failover_s: [cluster]
    failover_s of the standby head (kill-head)."""
    if scenario.deadline == TE_TIMEOUT:
        return float(te_timeout_s)
    if scenario.deadline == FAILOVER:
        return float(failover_s)
    if scenario.deadline == HEARTBEAT:
        return float(getattr(supervisor, "heartbeat_deadline_s", 3.0))
    if scenario.deadline == PROGRESS:
        return float(getattr(supervisor, "progress_deadline_s", 5.0))
    return None


def target_te(scenario: Scenario, te_types: dict[str, str], default: str = "te0") -> str:
    """The TE the scenario hits: `default`, or the first TE (by number) whose
    type is scenario.te_type. te_types: te id -> type (node config / health log)."""
    if scenario.te_type is None:
        return default
    matches = sorted((te for te, kind in te_types.items() if kind == scenario.te_type),
                     key=_te_number)
    if not matches:
        raise LookupError(f"{scenario.name}: no {scenario.te_type} TE "
                          f"(known: {te_types or 'none'})")
    return matches[0]


def target_tes(scenario: Scenario, te: str, te_types: dict[str, str]) -> list[str]:
    """The TEs the fault goes to: `te`, or (every_te_of_type) every TE of te's
    type, `te` first."""
    kind = te_types.get(te)
    if not scenario.every_te_of_type or kind is None:
        return [te]
    others = sorted((t for t, k in te_types.items() if k == kind and t != te), key=_te_number)
    return [te, *others]


def _te_number(te: str) -> int:
    return int(te[2:]) if te[2:].isdigit() else 1 << 30
