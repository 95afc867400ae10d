"""The cluster-manager half of tools/sim_cluster.py: the TE registry, the
TE-list push through the wire codec, the real scaling loop, and a simulated
supervisor that carries out its ScaleOut / ScaleIn.

    SimTE reports ──on_report──> ScalingControl (control/cm/scaling.py, real)
    every tick: ModelDemand ──> ScalingControl.step(now, listed) ──> drain ids
                                     │ ScaleOut / ScaleIn (send)
                                     ▼
    supervisor: TE up start_delay_s later (TEUp) / stopped at once (TEDown)
    every change, and every REPUBLISH_S: TEList ─msgpack encode─decode─> on_list (the JE)

Only TEs of the types in --mix start; a new one takes the type furthest below
its share among its model's TEs.
"""

from __future__ import annotations

from collections import Counter
from time import perf_counter
from typing import Callable

import msgspec

from deepserve.control.cm.autoscaler import ModelPolicy, ScalingOptions
from deepserve.control.cm.cluster_manager import REPUBLISH_S
from deepserve.control.cm.scaling import ScalingControl
from deepserve.messages.control import FromClusterManager, TEInfo, TEList, TEReport
from deepserve.messages.scaling import ModelDemand, ScaleOut

from sim_model import Profile, SimTE

TYPES = ("colocated", "prefill", "decode")


class SimClusterManager:
    """schedule(t, fn, *args): an event; clock(): simulated now; on_list(tes): the
    JE adopts a decoded TE list; stats: sim_stats.Stats."""

    def __init__(self, policies: list[ModelPolicy], mix: tuple[int, ...], profile: Profile,
                 schedule: Callable, clock: Callable[[], float],
                 on_list: Callable[[list[TEInfo]], None], stats):
        self.mix, self.profile, self.stats = mix, profile, stats
        self.schedule, self.clock, self.on_list = schedule, clock, on_list
        self.scaling = ScalingControl(policies, ScalingOptions(), self._supervise,
                                      lambda *a, **k: None, clock(), 3600.0, clock=clock)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(FromClusterManager)
        self.sims: dict[str, SimTE] = {}  # the TEs that run
        self.listed: dict[str, TEInfo] = {}  # the registry, TE-list order
        self.starting: dict[str, list[str]] = {p.name: [] for p in policies}  # types
        self.num_started = 0
        self.last_push = clock()

    def te_up(self, model: str, te_type: str, push: bool = True) -> None:
        """A started TE announces itself (TEUp)."""
        if te_type in self.starting[model]:
            self.starting[model].remove(te_type)
        self.num_started += 1
        te_id = f"{model}-{te_type[0]}{self.num_started}"
        info = TEInfo(te_id=te_id, te_type=te_type, model=model, address=f"ipc://sim/{te_id}",
                      block_size=self.profile.block_size, incarnation=f"sim-{te_id}")
        self.sims[te_id] = SimTE(info, self.profile)
        self.scaling.on_te_up(info, self.clock())
        self.listed[te_id] = info
        if push:
            self.push()

    def on_report(self, report: TEReport, model: str) -> None:
        self.scaling.on_report(report, model, self.clock())

    def is_draining(self, te_id: str) -> bool:
        return self.listed[te_id].draining

    def step(self, arrivals: Counter, parked: Counter) -> None:
        """One CM step: demand in, decisions out, drains published."""
        now = self.clock()
        self.scaling.on_demand(ModelDemand(arrivals=dict(arrivals), parked=dict(parked)), now)
        drained = self.scaling.step(now, self.listed)
        for te_id in drained:
            self.listed[te_id] = msgspec.structs.replace(self.listed[te_id], draining=True)
        if drained or now - self.last_push >= REPUBLISH_S:
            self.push()

    def push(self) -> None:
        """Publish the TE list through the wire codec, as the CM does."""
        t0 = perf_counter()
        data = self.encoder.encode(TEList(tes=list(self.listed.values()), cm_incarnation="sim"))
        tes = self.decoder.decode(data).tes
        self.stats.on_push(len(data), perf_counter() - t0, len(tes))
        self.on_list(tes)
        self.last_push = self.clock()

    def _supervise(self, msg) -> None:
        """The supervisor: ScaleOut starts TEs, ScaleIn stops a drained one."""
        now = self.clock()
        if isinstance(msg, ScaleOut):
            for _ in range(msg.count):
                te_type = self._type_for(msg.model)
                self.starting[msg.model].append(te_type)
                self.schedule(now + self.profile.start_delay_s, self.te_up, msg.model, te_type)
            self.stats.num_scale_out += msg.count
            return
        te = self.sims.pop(msg.te_id)
        self.stats.num_lost += len(te.waiting) + len(te.running) + (te.plan is not None)
        self.stats.num_scale_in += 1
        self.scaling.on_te_down(msg.te_id, msg.model, "scaled in", now)
        del self.listed[msg.te_id]
        self.push()

    def _type_for(self, model: str) -> str:
        """The type furthest below its share of the mix among the model's TEs."""
        have = Counter(te.te_type for te in self.listed.values()
                       if te.model == model and not te.draining)
        have.update(self.starting[model])
        weighted = [(have[t] / w, i) for i, (t, w) in enumerate(zip(TYPES, self.mix)) if w]
        return TYPES[min(weighted)[1]]
