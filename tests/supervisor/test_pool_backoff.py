"""The pre-warmed pool's crash-loop guard (supervisor/pool_backoff.py) through
NodeScaler.tick on a fake node and a fake clock (test_scaler.py's FakeNode):
a dead pod is replaced after the TEs' backoff, the pool is given up after
max_restarts deaths within restart_window_s (pool_gave_up, once) and stays
given up, as a TE's "failed" does; TEs then start cold. Every test kills
pods by setting their fake process's returncode."""

from __future__ import annotations

import pytest

from deepserve.supervisor.node_config import SupervisorConfig
from deepserve.supervisor.pool_backoff import POOL, PoolBackoff
from deepserve.supervisor.scaler import NodeScaler

from .test_scaler import FakeNode, _ready

BASE, MAX, RESTARTS, WINDOW = 0.5, 4.0, 4, 60.0
TICK = 0.1  # the supervisor's tick


@pytest.fixture
def pool(tmp_path):
    node = FakeNode(tmp_path, pool_size=1, supervisor=SupervisorConfig(
        restart_base_delay_s=BASE, restart_max_delay_s=MAX, max_restarts=RESTARTS,
        restart_window_s=WINDOW))
    scaler = NodeScaler(node, lambda msg: None, clock=lambda: 0.0)
    yield node, scaler
    scaler.close()
    node.ctx.term()


def _pods(node):
    return [name for name in node.table.procs if name.startswith("pool")]


def _kill(node, scaler):
    [pod] = scaler.pods
    node.table.procs[pod].returncode = 1
    return pod


def _respawn_delay(node, scaler, died_at):
    """Tick every TICK from died_at until a new pod is spawned: how long it took."""
    before = scaler.num_pods
    now = died_at
    while scaler.num_pods == before:
        scaler.tick(now)
        assert now - died_at < 100, "no pod was spawned again"
        now = round(now + TICK, 6)
    return round(now - TICK - died_at, 6)


def _gave_up(node):
    return [e for e in node.events if e[1] == "pool_gave_up"]


def test_the_fault_a_dead_pod_is_noticed_and_counted(pool):
    node, scaler = pool
    scaler.tick(0.0)
    assert _pods(node) == ["pool0"] and scaler.backoff.deaths == 0
    _kill(node, scaler)
    scaler.tick(1.0)
    assert "pool0" not in node.table and "pool0" not in scaler.pods
    assert scaler.backoff.deaths == 1
    assert scaler.backoff.policy.num_failures(POOL, 1.0) == 1
    assert scaler.num_pods == 1, "respawned on the very tick it died: no backoff"


def test_respawns_wait_the_base_delay_then_twice_as_long_up_to_the_max(pool):
    node, scaler = pool
    scaler.tick(0.0)
    delays, now = [], 0.0
    for _ in range(RESTARTS):
        _kill(node, scaler)
        delay = _respawn_delay(node, scaler, now)
        delays.append(delay)
        now = round(now + delay + 1.0, 6)  # the new pod lives a second
        scaler.tick(now)
    assert delays == [0.5, 1.0, 2.0, 4.0]  # min(MAX, BASE * 2**(n-1)) on the tick grid
    assert all(b > a for a, b in zip(delays, delays[1:]))
    assert not _gave_up(node)


def test_a_pod_adopted_as_a_te_is_no_death(pool):
    node, scaler = pool
    scaler.tick(0.0)
    scaler.on_message(_ready("pool0", 0.5), 0.5)
    scaler.start_te("m-0", "m", "queue", 1.0)  # takes pool0: it leaves the pool alive
    assert scaler.starting["m-0"].source == "prewarmed" and "m-0" in node.table
    scaler.starting.clear()
    scaler.tick(1.1)
    assert _pods(node) == ["pool1"]  # refilled at once: no backoff
    assert scaler.backoff.deaths == 0 and scaler.backoff.may_spawn(1.1)


def _die_and_respawn(node, scaler, count, now):
    """Kill the pool's pod `count` times, each respawned; the time after."""
    for _ in range(count):
        _kill(node, scaler)
        now = round(now + _respawn_delay(node, scaler, now), 6)
    return now


def test_max_restarts_deaths_respawn_one_more_gives_up_once_and_tes_start_cold(pool, caplog):
    node, scaler = pool
    scaler.tick(0.0)
    now = _die_and_respawn(node, scaler, RESTARTS, 0.0)  # 0.5 + 1 + 2 + 4 s: inside WINDOW
    assert scaler.num_pods == RESTARTS + 1 and not _gave_up(node)
    pod = _kill(node, scaler)
    with caplog.at_level("ERROR"):
        scaler.tick(now)
    assert "POOL GIVEN UP" in caplog.text
    [(component, _, details)] = _gave_up(node)
    assert component == POOL and details["pod"] == pod and details["exit_code"] == 1
    assert details["deaths"] == RESTARTS + 1 and scaler.backoff.given_up
    for t in range(1, 200):
        scaler.tick(now + t * TICK)
    assert scaler.num_pods == RESTARTS + 1 and not scaler.pods  # no pod spawned again
    scaler.start_te("m-0", "m", "queue", now + 20)  # no pod: cold, without waiting
    assert node.spawned == [("m-0", "m")] and scaler.starting["m-0"].source == "cold"
    assert len(_gave_up(node)) == 1


def test_given_up_stays_given_up_after_the_window_as_a_failed_te_does(pool):
    node, scaler = pool
    scaler.tick(0.0)
    now = _die_and_respawn(node, scaler, RESTARTS, 0.0)
    _kill(node, scaler)
    scaler.tick(now)
    later = now + 2 * WINDOW
    scaler.tick(later)
    assert scaler.backoff.policy.num_failures(POOL, later) == 0  # the deaths left the window
    assert scaler.backoff.given_up and not scaler.backoff.may_spawn(later)
    assert scaler.num_pods == RESTARTS + 1 and len(_gave_up(node)) == 1


def test_deaths_older_than_the_window_stop_counting(pool):
    """Not given up yet: a pod that dies once a window after the others is
    respawned after the base delay again, and the budget is whole."""
    node, scaler = pool
    scaler.tick(0.0)
    now = _die_and_respawn(node, scaler, RESTARTS, 0.0)
    now += WINDOW
    scaler.tick(now)
    now = _die_and_respawn(node, scaler, 1, now)
    _kill(node, scaler)
    assert _respawn_delay(node, scaler, now) == 2 * BASE  # death 2 of the new window
    assert not _gave_up(node) and scaler.backoff.deaths == RESTARTS + 2


def test_pods_dying_on_one_tick_count_together_and_give_up_once(tmp_path):
    """Deaths of all pods count together (each pod has its own name): a pool
    of 3 with max_restarts 1 is given up by the second of three deaths at
    once; the third, already given up, writes no second pool_gave_up."""
    node = FakeNode(tmp_path, pool_size=3, supervisor=SupervisorConfig(
        restart_base_delay_s=BASE, max_restarts=1))
    scaler = NodeScaler(node, lambda msg: None, clock=lambda: 0.0)
    scaler.tick(0.0)
    for pod in list(scaler.pods):
        node.table.procs[pod].returncode = -9
    scaler.tick(1.0)
    assert scaler.backoff.deaths == 3 and scaler.backoff.given_up
    [(_, _, details)] = _gave_up(node)
    assert details["deaths"] == 2 and details["pod"] == "pool1"
    assert scaler.num_pods == 3 and not scaler.pods
    scaler.close()
    node.ctx.term()


def test_the_backoff_uses_the_supervisor_config_and_the_te_policy():
    cfg = SupervisorConfig(restart_base_delay_s=0.25, restart_max_delay_s=3.0, max_restarts=7,
                           restart_window_s=9.0)
    policy = PoolBackoff(cfg, health=None).policy
    assert (policy.base_delay_s, policy.max_delay_s, policy.max_restarts,
            policy.window_s) == (0.25, 3.0, 7, 9.0)
