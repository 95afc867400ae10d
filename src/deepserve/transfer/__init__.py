"""DistFlow: point-to-point KV block transfer between pools (see distflow.py)."""

from deepserve.transfer.distflow import DistFlow
from deepserve.transfer.handle import TransferHandle
from deepserve.transfer.receiver import DistFlowReceiver
from deepserve.transfer.types import PeerEndpoint, PoolRegion, TransferError, TransferResult

__all__ = ["DistFlow", "DistFlowReceiver", "PeerEndpoint", "PoolRegion", "TransferError",
           "TransferHandle", "TransferResult"]
