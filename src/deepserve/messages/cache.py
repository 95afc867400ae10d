"""The node's KV tiers (host DRAM + disk): the tier service's channel, and
the cache ops a step carries to the workers.

    TE master ──TierLookup / TierReserve / TierCommit / TierRelease / TierDrop──┐
    job executor ──ContextUnpin─────────────────────────────────────────────────┴> [kv-cache PULL]
    kv-cache ──TierHits / TierReserved / TierCommitted──> the master's tier reply PULL
    kv-cache ──TierReport (PUSH, every second)──> cluster manager ──(PUB)──> JEs, gateways,
                                                              other hosts' kv-caches
    kv-cache ──PeerGet──> another host's kv-cache ──PeerBlocks + bytes──> (remote tier)

    master ══ StepBatch.cache_ops: CacheOp ══> every worker (its cache executor thread)
    worker r ──CacheOpsDone──> master

Blocks are named by their salted chained hash (cache/block_hash.py) within a
*model key* (one per model geometry: TEs of the same model share one host
pool and one disk directory). A full block is (2, L, H, bs, D): all layers
and every KV head of block_size tokens, in one host slot or one disk file.

Leases: a lookup pins the host slots and disk files it found, a reserve the
slots it handed out, until TierRelease / TierCommit, or until the lease
expires (a master that died releases nothing; its pins lapse).
"""

from __future__ import annotations

import msgspec

_STRUCT = dict(tag_field="kind", omit_defaults=True, kw_only=True)


class BlockGeometry(msgspec.Struct, array_like=True, frozen=True):
    """One full block of a model: (2, num_layers, num_kv_heads, block_size, head_dim)."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str  # "float32", "bfloat16", "float16"

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_layers, self.num_kv_heads, self.block_size, self.head_dim)


class ContextPin(msgspec.Struct, array_like=True, frozen=True):
    """On the request that creates a context (JE -> TE): when it ends, pin
    every full block of its prompt in the tiers until expires_at (time.time()).
    on_host: a turn that ended in tool calls (control/je/turn_pins.py): its
    blocks are held in host memory, then left cached (tiers/host_pins.py)."""

    context_id: str
    expires_at: float
    on_host: bool = False


class TierLookup(msgspec.Struct, tag="tier_lookup", **_STRUCT):
    """Which leading hashes does a lower tier hold? Answered with TierHits."""

    lookup_id: int
    model_key: str
    geometry: BlockGeometry
    hashes: list[int]
    reply_to: str
    prefill_tokens_per_s: float = 0.0
    """The TE's measured prefill speed: a tier service fetches what other hosts'
    hold only when the link beats recomputing at this speed (0: unknown, fetch)."""
    is_turn_pin: bool = False
    """The lookup of a turn pin's own prefill (ContextPin.on_host): what it finds
    held is not a hit on a pinned turn (tiers/host_pins.py counts those)."""


class TierHits(msgspec.Struct, tag="tier_hits", **_STRUCT):
    """slots[i] for hashes[i] of the leading run held: a host slot (>= 0) or
    ON_DISK. lease_id pins them (0: nothing held)."""

    lookup_id: int
    lease_id: int = 0
    slots: list[int] = []
    segment: str = ""  # the host pool's shared-memory name
    disk_dir: str = ""  # where the model key's block files are


ON_DISK = -1
"""A TierHits slot: the block is in a file, not in host memory."""
ON_STREAM = -2
"""A load_layers slot: the block comes from the decode TE's layer stream (CacheOp.stream)."""
NO_SLOT = -1
"""A TierReserved slot: nothing to write (present already, or no room)."""


class TierReserve(msgspec.Struct, tag="tier_reserve", **_STRUCT):
    """Slots to write these blocks into. With context_id every hash is also
    pinned for that context until expires_at (time.time()), present or not."""

    reserve_id: int
    model_key: str
    geometry: BlockGeometry
    hashes: list[int]
    reply_to: str
    context_id: str | None = None
    expires_at: float = 0.0
    hold: bool = False
    """For a staging whose blocks stay held until its prefill TE loads them
    (DualPath's decode path): slots only for as many leading blocks as the
    tier can hold (tiers/tier_index.py); the rest NO_SLOT."""
    on_host: bool = False
    """The context_id pin holds the blocks in host slots (ContextPin.on_host)."""


class TierReserved(msgspec.Struct, tag="tier_reserved", **_STRUCT):
    """slots[i] for hashes[i]: a slot to write, or NO_SLOT. error: the whole
    reserve failed ("over_budget": a context's pins do not fit)."""

    reserve_id: int
    lease_id: int = 0
    slots: list[int] = []
    segment: str = ""
    error: str | None = None


class TierCommit(msgspec.Struct, tag="tier_commit", **_STRUCT):
    """The reserve's writes are done: `slots` hold their blocks now (the rest
    of the lease's slots were not written and go back). With reply_to set,
    answered by TierCommitted."""

    lease_id: int
    model_key: str
    slots: list[int]
    reply_to: str = ""
    reserve_id: int = 0
    hold: bool = False
    """Keep the written slots read-pinned under the same lease until its
    TierRelease (or its expiry): a decode TE's staged blocks wait there for
    its prefill TE to load them, whatever else the host tier takes meanwhile."""


class TierCommitted(msgspec.Struct, tag="tier_committed", **_STRUCT):
    reserve_id: int
    ok: bool = True


class TierRelease(msgspec.Struct, tag="tier_release", **_STRUCT):
    lease_id: int
    model_key: str


class TierDrop(msgspec.Struct, tag="tier_drop", **_STRUCT):
    """These blocks are bad where they are stored (a disk file failed its
    checksum): forget them and delete their files."""

    model_key: str
    hashes: list[int]


class ContextUnpin(msgspec.Struct, tag="context_unpin", **_STRUCT):
    """The context was deleted or expired: free every block only it pinned."""

    context_id: str


ToTier = TierLookup | TierReserve | TierCommit | TierRelease | TierDrop | ContextUnpin
FromTier = TierHits | TierReserved | TierCommitted


class TierReport(msgspec.Struct, tag="tier_report", **_STRUCT):
    """The tier service's state, for /metrics: bytes held per tier, live
    contexts, and whether the disk tier is on."""

    host_bytes: int = 0
    host_capacity: int = 0
    disk_bytes: int = 0
    disk_capacity: int = 0
    num_contexts: int = 0
    pinned_bytes: int = 0
    disk_enabled: bool = False
    num_corrupt: int = 0
    peer: str = ""
    """Where other hosts' tier services fetch this one's blocks (tiers/remote_tier.py;
    "": one host). The CM relays the report, so every tier service learns its peers."""
    num_remote_hits: int = 0
    """Blocks this service fetched from other hosts' tiers (so far)."""
    num_turn_pins: int = 0
    """Turns that ended in tool calls held in host memory now (tiers/host_pins.py)."""
    turn_pin_hits: int = 0
    """Blocks lookups found held by those pins (so far)."""
    turn_pins_refused: int = 0
    """Such pins past their budget (so far)."""


# -- tier service <-> tier service on another host (tiers/remote_tier.py) ------------
class PeerGet(msgspec.Struct, tag="peer_get", **_STRUCT):
    """The leading run of these blocks that the peer holds in host memory."""

    model_key: str
    geometry: BlockGeometry
    hashes: list[int]


class PeerBlocks(msgspec.Struct, tag="peer_blocks", **_STRUCT):
    """The first num_blocks of the asked hashes; their bytes follow in one frame
    (num_blocks whole blocks, in order)."""

    num_blocks: int = 0


# -- master -> workers (inside a StepBatch) ------------------------------------------
LOAD_HOST, LOAD_DISK, STORE_HOST, STAGE_DISK = "load_host", "load_disk", "store_host", "stage"
LOAD_LAYERS, DROP_LAYERS = "load_layers", "drop_layers"
STAGE_STREAM, DROP_STREAM = "stage_stream", "drop_stream"


class CacheOp(msgspec.Struct, array_like=True, omit_defaults=True):
    """One copy job for every rank (each copies its own KV heads):
    load_host   host slots[i] -> device block_ids[i]
    load_disk   the block file of hashes[i] under disk_dir -> device block_ids[i]
    store_host  device block_ids[i] -> host slots[i]
    stage       the block file of hashes[i] -> host slots[i] (rank 0; block_ids unused):
                a decode TE reads storage for a prefill TE (DualPath's DE read path)
    load_layers host slots[i] (ON_DISK: the block file of hashes[i]) -> device
                block_ids[i] of sequence seq_id, layer by layer (worker/layer_loads.py,
                tp 1): the first `layers` layers are read now (CacheOpsDone then),
                the rest during that sequence's next forward, each copied in just
                before its layer computes
                ON_STREAM: row stream_rows[k] of the layer stream at `stream` (the
                k-th such block), pulled a layer at a time (DualPath's DE -> PE hop)
    drop_layers the layered load of seq_id is not wanted (block_ids unused)
    stage_stream the block files of hashes -> a buffer served as layer stream seq_id
                (rank 0; transfer/layer_stream.py): DualPath's DE read path when the
                prefill TE is on another host. CacheOpsDone.stream: its address
    drop_stream the layer stream seq_id is not wanted any more
    Loads stop at the first block that fails (CacheOpsDone.num_ok); disk reads
    (load_disk, stage, load_layers) go through the TE's storage_read_gbps bucket."""

    op_id: int
    kind: str
    block_ids: list[int]
    slots: list[int] = []
    hashes: list[int] = []
    segment: str = ""
    disk_dir: str = ""
    seq_id: int = -1
    layers: int = 0
    stream: str = ""  # load_layers: the layer stream's address
    stream_id: int = -1  # load_layers: its id there
    stream_rows: list[int] = []  # load_layers: the stream row of each ON_STREAM block


class CacheOpsDone(msgspec.Struct, tag="cache_ops_done", **_STRUCT):
    """Worker -> master: one rank did `op_id`'s first num_ok blocks.
    error names why it stopped there; corrupt: hashes whose file failed its check."""

    rank: int
    op_id: int
    num_ok: int
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    corrupt: list[int] = []
    stream: str = ""  # stage_stream: where the blocks are served
