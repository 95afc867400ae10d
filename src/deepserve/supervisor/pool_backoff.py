"""The pre-warmed pool's crash-loop guard: a dead pod is replaced after a
backoff, and a pool whose pods keep dying is given up.

Why: the pool replaced a dead pod on the next tick (every 0.1 s), so a pod
that cannot come up (a broken install, a module that fails to import, no
memory) was forked ten times a second for the node's life, each one
importing torch on the node's few cores. A pod's death is judged as a TE's
crash is (restart_policy.RestartPolicy, with the same [supervisor] keys:
restart_base_delay_s, restart_max_delay_s, max_restarts, restart_window_s),
all pods as one component, POOL (each pod has a name of its own, so deaths
counted per pod would never add up):

    pod died at t ──> death n of the pool in (t - restart_window_s, t]
        n <= max_restarts: no pod is spawned before t + min(max, base * 2**(n-1))
        n >  max_restarts: given up, once and for the node's life (a TE's
                           "failed" is too): no pod is spawned again

Deaths older than the window stop counting, for the budget and for the
backoff exponent, as a TE's do. A pod adopted as a TE left the pool alive:
no death. Given up, scale-outs and TE restarts start cold (the scaler finds
no pod), as with pool_size = 0.
"""

from __future__ import annotations

import logging
import math

from deepserve.supervisor.restart_policy import GIVE_UP, Decision, RestartPolicy

log = logging.getLogger(__name__)

POOL = "pool"
"""The one component name every pod's death is counted (and logged) under."""


class PoolBackoff:
    """When the pool may spawn a pod. cfg: a SupervisorConfig; health: the
    node's HealthLog (pool_gave_up is written there, once)."""

    def __init__(self, cfg, health):
        self.cfg, self.health = cfg, health
        self.policy = RestartPolicy(cfg.restart_base_delay_s, cfg.restart_max_delay_s,
                                    max_restarts=cfg.max_restarts,
                                    window_s=cfg.restart_window_s)
        self.not_before = -math.inf  # no pod is spawned before this time
        self.deaths = 0  # every pod death seen, given up or not

    @property
    def given_up(self) -> bool:
        return self.policy.is_failed(POOL)

    def may_spawn(self, now: float) -> bool:
        return not self.given_up and now >= self.not_before

    def on_death(self, pod: str, exit_code, now: float) -> Decision:
        """Pod `pod` died at `now` (exit_code: its returncode): when the next
        pod may be spawned, or the pool given up (logged loudly, once)."""
        was_given_up = self.given_up
        decision = self.policy.on_failure(POOL, now)
        self.deaths += 1
        if decision.action != GIVE_UP:
            self.not_before = max(self.not_before, now + decision.delay_s)
            log.warning("pre-warmed process %s exited (%s): replaced in %.3g s (pod death %d "
                        "of %d allowed within %g s)", pod, exit_code, decision.delay_s,
                        decision.attempt, self.cfg.max_restarts, self.cfg.restart_window_s)
        elif not was_given_up:
            self._give_up(pod, exit_code, decision.attempt)
        else:
            log.warning("pre-warmed process %s exited (%s): the pool gave up, not replaced",
                        pod, exit_code)
        return decision

    def _give_up(self, pod: str, exit_code, deaths: int) -> None:
        reason = (f"{deaths} pod deaths within {self.cfg.restart_window_s:g} s (max_restarts "
                  f"{self.cfg.max_restarts}): crash loop, no pod is started again; "
                  f"TEs start cold")
        log.error("pre-warmed process %s exited (%s): POOL GIVEN UP: %s", pod, exit_code, reason)
        self.health.write(POOL, "pool_gave_up", None, pod=pod, exit_code=exit_code,
                          deaths=deaths, reason=reason)
