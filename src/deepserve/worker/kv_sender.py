"""A worker's side of PD disaggregation: send a step's KV over DistFlow.

    StepBatch.transfers ──> KVSender ──DistFlow.transfer──> decode TE's rank r pool
                                     └──KVSent(rank, nbytes, seconds | error)──> master

By request, the blocks go after the step's forward, all layers at once.
Layer-wise, layer i's blocks go as soon as layer i is computed, on DistFlow's
thread, while this thread computes layer i+1; the step ends when the last
layer is in. Either way the step reports only once its transfers are done,
so the master never tells the decode TE about KV that is not there yet.

A TE whose peers send with the ring or tcp backend runs a DistFlowReceiver
(it writes what arrives into this worker's pool); with shm the sender writes
into the pool's segment directly and no receiver is needed.

Links are kept per decode TE (dst_te) with the endpoint they were made for.
A decode TE that restarted comes back with another pool segment (or
receiver): its new endpoint replaces the old link, which unmaps the old pool
(shm) or unlinks our staging segment (ring), so restarts leak no mapping.
At most MAX_LINKS peers stay linked; the least recently used goes first.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch
import zmq

from deepserve.config import EngineConfig
from deepserve.faults import FaultHooks, NoFaults
from deepserve.messages.pd import KVEndpoint, KVSent, KVTransferOrder
from deepserve.messages.step import StepBatch, StepOutput
from deepserve.transfer import (DistFlow, DistFlowReceiver, PeerEndpoint, PoolRegion,
                                TransferError)
from deepserve.transfer.receiver import kv_bind

log = logging.getLogger(__name__)

MAX_LINKS = 32  # decode TEs linked at once


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KVSender:
    def __init__(self, pool: torch.Tensor, segment: str, rank: int, config: EngineConfig,
                 ctx: zmq.Context, faults: FaultHooks | NoFaults, bind: str = ""):
        """bind: where its DistFlow receiver (ring, tcp) listens; "": kv_bind's
        choice for config.kv_bind_host."""
        self.rank, self.backend = rank, config.kv_transfer_backend
        self.timeout_s = config.kv_transfer_timeout_s
        self.distflow = DistFlow(pool, timeout_s=self.timeout_s, ctx=ctx)
        self.receiver = None
        endpoint = KVEndpoint(shape=tuple(pool.shape), dtype=_dtype_name(pool.dtype), shm=segment)
        if self.backend in ("ring", "tcp"):
            self.receiver = DistFlowReceiver(pool, bind=bind or kv_bind(config.kv_bind_host),
                                             ctx=ctx)
            e = self.receiver.endpoint(shm_name=segment)
            endpoint = KVEndpoint(shape=endpoint.shape, dtype=endpoint.dtype, shm=segment,
                                  tcp=e.tcp)
        self.endpoint = endpoint
        self._links: OrderedDict[str, KVEndpoint] = OrderedDict()  # dst_te -> linked endpoint
        self.faults = faults  # the worker's (NoFaults when drills are off)

    def execute(self, runner, batch: StepBatch) -> tuple[StepOutput, list[KVSent]]:
        handles: dict[int, list] = {t.seq_id: [] for t in batch.transfers}
        errors: dict[int, str] = {}
        started = time.monotonic()
        layerwise = [t for t in batch.transfers if t.layerwise]

        def after_layer(i: int) -> None:
            for t in layerwise:
                self._send(t, (i, i + 1), handles, errors)

        output = runner.execute(batch, after_layer if layerwise else None)
        for t in batch.transfers:
            if not t.layerwise:
                self._send(t, None, handles, errors)
        sent = []
        for t in batch.transfers:
            nbytes = 0
            for handle in handles[t.seq_id]:
                try:
                    nbytes += handle.wait(self.timeout_s).nbytes
                except TransferError as e:
                    errors.setdefault(t.seq_id, str(e))
            sent.append(KVSent(rank=self.rank, seq_id=t.seq_id, nbytes=nbytes,
                               seconds=time.monotonic() - started, error=errors.get(t.seq_id)))
        return output, sent

    def _send(self, t: KVTransferOrder, layers, handles, errors) -> None:
        if t.seq_id in errors:
            return
        if layers in (None, (1, 2)) and self.faults.consume("kv-fail") is not None:
            errors[t.seq_id] = "drill: transfer broken mid-way"  # after layer 0 if layer-wise
            return
        peer = t.dst_te
        try:
            self._link(peer, t.dst_endpoints[self.rank])
            handles[t.seq_id].append(self.distflow.transfer(
                peer, PoolRegion(t.src_block_ids, layers), PoolRegion(t.dst_block_ids, layers)))
        except TransferError as err:
            errors[t.seq_id] = str(err)

    def _link(self, peer: str, e: KVEndpoint) -> None:
        """Link to the peer's current endpoint; a new one (the peer restarted)
        replaces the old link, releasing its mappings."""
        if self._links.get(peer) == e:
            self._links.move_to_end(peer)
            return
        self._links.pop(peer, None)  # DistFlow.link closes the old link first
        self.distflow.link(peer, PeerEndpoint(shape=tuple(e.shape), dtype=e.dtype, shm=e.shm,
                                              tcp=e.tcp), self.backend)
        self._links[peer] = e
        while len(self._links) > MAX_LINKS:
            old, _ = self._links.popitem(last=False)
            self.distflow.unlink(old)

    @property
    def num_links(self) -> int:
        return len(self._links)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.distflow.close()
