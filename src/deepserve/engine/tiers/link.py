"""TierLink: the master's sockets to the node's KV tier service, and the
TierCoordinator's effects carried out (what the master itself need not know).

    master ──ToTier (PUSH)──> kv-cache       kv-cache ──FromTier──> [tier PULL, bound here]
    TierEffects.ops ──(attach_ops: the next StepBatch, or a cache-only batch)──> workers

The master asks `take` for what it must do itself: queue the ready
sequences, and stream (or fail) the context requests whose pins are done.
A TE without a tier service holds a NoTierLink instead: the same calls,
admission straight to the scheduler, nothing below the device.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Callable

import zmq

from deepserve.cache.kv_manager import KVCacheManager
from deepserve.engine.sequence import Sequence
from deepserve.engine.tiers.channel import TierEffects
from deepserve.engine.tiers.coordinator import TierCoordinator
from deepserve.ipc.sockets import PullSocket, PushSocket
from deepserve.messages.cache import (BlockGeometry, CacheOp, FromTier, TierCommitted,
                                      TierHits, TierReserved)
from deepserve.tiers.cost_model import CostModel

log = logging.getLogger(__name__)
PUT_TIMEOUT_S = 0.05  # a tier service that does not take a message: it is dropped (a miss)


def tier_reply_address(pd_or_inbox: str) -> str:
    """ipc://DIR/te1.pd.sock -> ipc://DIR/te1.tier.sock; tcp://H:P -> tcp://H:P+1."""
    scheme, _, rest = pd_or_inbox.partition("://")
    if scheme == "ipc":
        stem = rest.removesuffix(".sock").removesuffix(".pd")
        return f"ipc://{stem}.tier.sock"
    host, _, port = rest.rpartition(":")
    return f"tcp://{host}:{int(port) + 1}"


def model_key(model_dir: str, geometry: BlockGeometry) -> str:
    """The key TEs of one model share: the directory and the block geometry."""
    real = os.path.realpath(model_dir)
    digest = hashlib.sha1(f"{real}|{geometry}".encode()).hexdigest()[:12]
    return f"{Path(real).name}-{digest}"


class TierLink:
    def __init__(self, ctx: zmq.Context, tier_address: str, reply_address: str,
                 kv: KVCacheManager, model_dir: str, geometry: BlockGeometry, tp: int,
                 block_bytes: int, new_seq_id, cost_model: bool = True, events=None):
        self.replies = PullSocket(ctx, reply_address, bind=True, type=FromTier)
        try:
            self.to_tier = PushSocket(ctx, tier_address, bind=False)
        except BaseException:  # never an open socket left behind: ctx.term() would wait
            self.replies.close()
            raise
        cost = CostModel(block_bytes=block_bytes, block_size=kv.block_size, enabled=cost_model)
        self.tiers = TierCoordinator(kv, model_key=model_key(model_dir, geometry),
                                     geometry=geometry, address=reply_address, cost=cost, tp=tp,
                                     new_seq_id=new_seq_id)
        self.events = events or (lambda event, **details: None)
        self.pending_ops: list[CacheOp] = []
        self.num_dropped = 0
        self._ready: list[Sequence] = []
        self._staged: list[Sequence] = []
        self._ended: list[Sequence] = []
        self._failed: list[tuple[Sequence, str, str]] = []

    @classmethod
    def of_master(cls, ctx: zmq.Context, spec, kv: KVCacheManager, model_config,
                  block_bytes: int, new_seq_id, events) -> "TierLink":
        """A master's link (spec: its MasterSpec, engine/te/specs.py; model_config: its model's)."""
        m, cfg = model_config, spec.config
        geometry = BlockGeometry(m.num_layers, m.num_kv_heads, cfg.block_size, m.head_dim,
                                 str(m.dtype).removeprefix("torch."))
        link = cls(ctx, spec.tier_address, tier_reply_address(spec.pd_address), kv, cfg.model,
                   geometry, cfg.tp, block_bytes, new_seq_id, spec.cache_cost_model, events)
        link.tiers.storage.rate = (cfg.storage_read_gbps or 0) * 1e9 or None  # its bucket
        link.tiers.layered.layers = cfg.kv_load_layers
        link.tiers.staging.hop = cfg.dualpath_hop
        link.tiers.staging.stream_host = cfg.kv_bind_host if cfg.kv_stream_bytes else ""
        return link

    @property
    def socket(self) -> zmq.Socket:
        return self.replies.socket

    def register(self, poller: zmq.Poller) -> None:
        """Poll the replies with the master's inboxes."""
        poller.register(self.socket, zmq.POLLIN)

    @property
    def has_work(self) -> bool:
        return self.tiers.has_work

    can_pin_contexts = True  # a context request's KV is written to the tiers, then streamed

    @property
    def num_events(self) -> int:
        """Tier events so far (the master's progress counts them)."""
        return self.tiers.num_events

    def report(self, num_device_hits: int, block_size: int) -> dict:
        """The tier fields of the master's TEReport (messages/control.py)."""
        hits, fetch_seconds = self.tiers.pop_stats()
        return dict(tier_hit_tokens={**hits, "device": num_device_hits},
                    tier_fetch_seconds={t: s for t, s in fetch_seconds.items() if s},
                    cost_model=self.tiers.cost.snapshot(),
                    storage_queue_tokens=self.tiers.read_queue_blocks * block_size,
                    storage_read_bytes=dict(self.tiers.storage.bytes_read),
                    tier_lookups=dict(self.tiers.lookups_by_outcome))

    # -- what the master calls ---------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        self._apply(self.tiers.admit(seq, time.monotonic()))

    def pin_context(self, seq: Sequence, nodes) -> None:
        self._apply(self.tiers.write_through(time.monotonic(), context=seq, nodes=nodes))

    def recv(self) -> None:
        now = time.monotonic()
        for msg in self.replies.drain():
            if isinstance(msg, TierHits):
                self._apply(self.tiers.on_hits(msg, now))
            elif isinstance(msg, TierReserved):
                self._apply(self.tiers.on_reserved(msg, now))
            elif isinstance(msg, TierCommitted):
                self._apply(self.tiers.on_committed(msg, now))

    def on_ops_done(self, msg) -> None:
        self._apply(self.tiers.on_ops_done(msg, time.monotonic()))

    def tick(self) -> None:
        """New tree blocks go to the host tier; deadlines."""
        now = time.monotonic()
        self._apply(self.tiers.write_through(now))
        self._apply(self.tiers.poll(now))

    def observe_step(self, num_new_tokens, seconds: float) -> None:
        """A step that is mostly prompt tokens measures the prefill speed (cost model)."""
        counts = list(num_new_tokens)
        prompt = sum(n for n in counts if n > 1)
        if prompt * 2 >= sum(counts):
            self.tiers.cost.observe_prefill(prompt, seconds)

    def lost_layers(self, corrupt: list[int]) -> None:
        """A layered load failed in its request's forward (StepOutput.lost_loads)."""
        self._apply(self.tiers.lost_layers(corrupt))

    def take(self):
        """(sequences to queue, decode tasks staged, contexts to end, contexts
        that failed: (seq, error, why)) since the last call."""
        out = self._ready, self._staged, self._ended, self._failed
        self._ready, self._staged, self._ended, self._failed = [], [], [], []
        return out

    def stage(self, seq: Sequence, prefill_from: str = "") -> None:
        """DualPath's decode read path: the prompt's disk blocks up to host first
        (or into a layer stream for the prefill TE at PD address prefill_from)."""
        self._apply(self.tiers.stage(seq, time.monotonic(), prefill_from))

    def unstage(self, seq_id: int) -> None:
        """A staged decode task's KV arrived, or the task ended: let its blocks go."""
        self._apply(self.tiers.unstage(seq_id))

    def take_ops(self) -> list[CacheOp]:
        ops, self.pending_ops = self.pending_ops, []
        return ops

    # -- effects -----------------------------------------------------------------------
    def _apply(self, effects: TierEffects) -> None:
        if not effects:
            return
        for msg in effects.sends:
            try:
                self.to_tier.put(msg, timeout=PUT_TIMEOUT_S)
            except TimeoutError:  # its deadline turns what waits on it into a miss
                self.num_dropped += 1
        self.pending_ops.extend(effects.ops)
        self._ready.extend(effects.ready)
        self._staged.extend(effects.staged)
        self._ended.extend(effects.ended)
        self._failed.extend(effects.failed)
        for event, details in effects.events:
            log.warning("%s: %s", event, details)
            self.events(event, **details)

    def close(self) -> None:
        self.to_tier.close()
        self.replies.close()


class NoTierLink:
    """A TE without a tier service (or without prefix caching): admission
    queues straight away (enqueue: the scheduler's add), a staged decode task
    is staged at once (nothing to bring up from disk), and nothing else happens."""

    socket = None  # nothing to poll
    has_work = False
    can_pin_contexts = False  # a context request streams as any other
    num_events = 0
    num_dropped = 0
    pending_ops: list[CacheOp] = []  # never filled

    def __init__(self, enqueue: Callable[[Sequence], None]):
        self.admit = enqueue
        self._staged: list[Sequence] = []

    def stage(self, seq: Sequence, prefill_from: str = "") -> None:
        self._staged.append(seq)

    def unstage(self, seq_id: int) -> None: ...  # nothing was held

    def take(self):
        """(ready, staged, ended, failed) as TierLink.take: only staged decode tasks."""
        staged, self._staged = self._staged, []
        return [], staged, [], []

    def take_ops(self) -> list[CacheOp]:
        return []

    def report(self, num_device_hits: int, block_size: int) -> dict:
        return {}  # TEReport's defaults: no tier fields

    def pin_context(self, seq: Sequence, nodes) -> None: ...  # never asked: can_pin_contexts

    def register(self, poller) -> None: ...

    def recv(self) -> None: ...

    def on_ops_done(self, msg) -> None: ...

    def tick(self) -> None: ...

    def observe_step(self, num_new_tokens, seconds: float) -> None: ...

    def lost_layers(self, corrupt: list[int]) -> None: ...  # never loads any

    def close(self) -> None: ...
