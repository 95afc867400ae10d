"""ClusterView: what the gateway knows of the TEs, from the cluster manager's PUB.

    CM PUB ──TEList / TEReport / TierReport──> JobClient's SUB ──> ClusterView.on_message
        te_ids (admission, /health), addresses (aborts of orphaned attempts),
        reports and the KV tiers' state (metrics)
"""

from __future__ import annotations

import time

from deepserve.gateway.metrics import GatewayMetrics
from deepserve.messages.cache import TierReport
from deepserve.messages.control import TEInfo, TEList, TEReport, TermFence
from deepserve.messages.scaling import ScaleEvent

REPORT_TTL_S = 10.0
"""Before the first TEList arrives, a TE that sent a TEReport this recently counts as up."""


class ClusterView:
    def __init__(self, metrics: GatewayMetrics | None = None):
        self.metrics = metrics
        self._tes: dict[str, TEInfo] = {}
        self._has_te_list = False
        self._reports: dict[str, TEReport] = {}
        self._report_times: dict[str, float] = {}
        self.tier_report: TierReport | None = None  # the KV tier service's latest
        self.terms = TermFence()  # several heads: only the newest term's lists count

    def on_message(self, msg: TEList | TEReport | ScaleEvent | TierReport) -> None:
        if isinstance(msg, TierReport):
            self.tier_report = msg
            return
        if isinstance(msg, ScaleEvent):
            if self.metrics is not None:
                self.metrics.observe_scale_event(msg)
            return
        if isinstance(msg, TEList):
            if not self.terms.admits(msg) or not msg.is_complete:
                return  # a deposed head's, or a CM that has not heard from its TEs yet
            self._tes = {te.te_id: te for te in msg.tes}
            self._has_te_list = True
            for te_id in set(self._reports) - set(self._tes):
                del self._reports[te_id]
                self._report_times.pop(te_id, None)
        else:
            self._reports[msg.te_id] = msg
            self._report_times[msg.te_id] = time.monotonic()
            if self.metrics is not None:
                self.metrics.observe_te_report(msg)

    @property
    def te_ids(self) -> list[str]:
        """TEs up: those of the latest TEList; before the first one arrives,
        those that reported within REPORT_TTL_S (a late subscriber's view)."""
        if self._has_te_list:
            return list(self._tes)
        now = time.monotonic()
        return [te for te, t in self._report_times.items() if now - t < REPORT_TTL_S]

    def te_ids_of(self, model: str) -> list[str]:
        """The listed TEs of one model (none before the first TE list)."""
        return [te.te_id for te in self._tes.values() if te.model == model]

    @property
    def tes(self) -> list[TEInfo]:
        return list(self._tes.values())

    @property
    def addresses(self) -> list[str]:
        """The listed TEs' inboxes (their tokenizers take AbortRequest)."""
        return [te.address for te in self._tes.values()]

    @property
    def reports(self) -> dict[str, TEReport]:
        return dict(self._reports)
