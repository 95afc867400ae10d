"""Effects: what the master carries out after a PD event, both sides' answer."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepserve.engine.sequence import Sequence
from deepserve.messages.pd import CancelOrder, FailRequest, KVAck, KVReady, PrefillOrder


@dataclass
class Effects:
    """What the master does after a PD event, in this order: send each message
    to its peer's PD address; track `started` (request id, seq: queued already);
    stream a token of each `emit` seq; fail `failed`; release `released`."""

    sends: list[tuple[str, PrefillOrder | KVReady | KVAck | CancelOrder]] = field(
        default_factory=list)
    started: list[tuple[str, Sequence]] = field(default_factory=list)
    emit: list[Sequence] = field(default_factory=list)
    failed: list[FailRequest] = field(default_factory=list)
    released: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.sends or self.started or self.emit or self.failed or self.released)
