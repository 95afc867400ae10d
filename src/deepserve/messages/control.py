"""Control-plane channels of a node: TEs -> cluster manager -> job executors
and gateways.

    TE master ──TEReport (PUSH, every report_interval_s)──> CM
    TE host   ──TEUp / TEDown (PUSH)──────────────────────> CM   (TEUp every TEUP_INTERVAL_S)
    CM ──TEList (on every change) / TEReport (relayed) (PUB)──> JEs, gateways
    gateway ──SubmitRequest / AbortRequest (PUSH)──> JE ──(chosen TE)──> TE tokenizer
    TE tokenizer ──RequestDelta (PUSH to reply_to)──> gateway   (streaming shortcut)
    JE ──RequestFailed (PUSH to reply_to)──> gateway           (no TE, TE died, ...)

Cache locality travels as *block hashes*: the hash of a full KV block chains
the hash of the block before it (see cache/block_hash.py), so a set of hashes
per TE answers "how many leading blocks of this prompt does that TE hold".
"""

from __future__ import annotations

import msgspec

from deepserve.messages.cache import TierReport
from deepserve.messages.scaling import ModelDemand, NodeReport, ScaleEvent

_STRUCT = dict(tag_field="kind", omit_defaults=True, kw_only=True)


class TEInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """te_type: "colocated", "prefill" or "decode"; address: its tokenizer's inbox."""

    te_id: str
    te_type: str = "colocated"
    model: str
    address: str
    num_devices: int = 1
    block_size: int = 16
    draining: bool = False
    """Chosen for scale-in: routed nothing new; its tasks run to their end."""
    max_num_seqs: int = 0
    """Requests it runs at once at most (its engine's max_num_seqs): the job
    executor sends it no more, holding the rest in its fair queue; 0: unknown,
    no bound."""
    incarnation: str = ""
    """The TE process's run id (new on every restart): the CM's re-up fence
    holds back only the incarnation that went down."""
    max_model_len: int = 0
    """Tokens of one sequence at most (its resolved engine config): the
    gateway's /v1/models and /tokenize show it; 0: unknown."""


class TEUp(msgspec.Struct, tag="te_up", **_STRUCT):
    info: TEInfo


TEUP_INTERVAL_S = 2.0
"""A TE host repeats its TEUp this often, so a restarted CM relearns its TEs
(the CM's first TE list waits 1.5 intervals for them: cm/cluster_manager.py)."""


class TEDown(msgspec.Struct, tag="te_down", **_STRUCT):
    te_id: str
    reason: str
    address: str = ""
    """The inbox of the TE going down, when the sender knows it ("": the
    supervisor's, trusted): a TEDown for another TE of that id is ignored."""
    part: str = ""
    """The TE's process that failed: worker0, master, tokenizer, host (the TE
    server itself); "" when not known. The JE tells a request of death, which
    fails the same part each time, from one caught in two unrelated faults."""


class TEReport(msgspec.Struct, tag="te_report", **_STRUCT):
    """Load and cache changes since the previous report of one TE.

    load = tokens waiting + tokens running (still to compute or generate).
    inserted / evicted: block hashes that entered / left its prefix cache.
    finished: request ids that ended on it (any reason).
    """

    te_id: str
    num_waiting: int
    num_running: int
    load_tokens: int
    kv_usage: float
    num_prompt_tokens: int = 0  # cumulative
    num_cached_tokens: int = 0  # cumulative: prefix-cache hits
    inserted: list[int] = []
    evicted: list[int] = []
    finished: list[str] = []
    kv_transfer_bytes: int = 0  # KV this TE sent to decode TEs since the last report
    kv_transfer_seconds: list[float] = []  # one per request sent
    tier_hit_tokens: dict[str, int] = {}  # cumulative cached prompt tokens by tier (device:
    # what its own pool served, not a prefill TE's hits a decode task adopted)
    kv_cached_bytes: int = 0  # bytes of KV blocks in its prefix tree (all ranks)
    cost_model: dict[str, float] = {}  # what its fetch-or-recompute model believes now
    storage_queue_tokens: int = 0  # tokens it still has to read from the disk tier (reads
    # dispatched, and the disk hits of requests waiting for room in its pool)
    storage_read_bytes: dict[str, int] = {}  # cumulative disk reads by path: prefill, decode
    num_free_tokens: int = 0  # tokens its KV pool can still take
    tier_fetch_seconds: dict[str, list[float]] = {}  # fetches since the last report, per tier
    read_paths: dict[str, int] = {}  # cumulative decode tasks taken, by DualPath's read path
    tier_lookups: dict[str, int] = {}  # cumulative lookups below the device, by outcome:
    # fetch, none (no tier holds the prefix), recompute (the cost model's choice), no_room
    # (no device blocks to load into: it waits for them, then looks again), room_timeout
    # (it waited op_timeout_s: computed), gap, timeout (the tier service did not answer),
    # fetch_layers (a fetch loaded layer by layer: kv_load_layers), layers_lost (such a load
    # failed inside its request's forward: the request was retried)


ToClusterManager = (TEUp | TEDown | TEReport | ModelDemand | ScaleEvent | TierReport
                    | NodeReport)


class TEList(msgspec.Struct, tag="te_list", **_STRUCT):
    """Every TE the cluster manager considers available, after a change.

    cm_incarnation: a random id per CM process start ("" from an older CM).
    is_complete: the CM has heard from its TEs since it started (a restarted
    CM publishes nothing until its TEs' TEUp repeats came in), so an empty
    list means "no TE", not "not heard yet". A subscriber ignores a list with
    is_complete = False: it neither fails tasks of TEs missing from it nor
    routes by it.
    """

    tes: list[TEInfo]
    cm_incarnation: str = ""
    is_complete: bool = True
    down: dict[str, str] = {}
    """TE id -> the part it went down with (TEDown.part), for the TEs this CM
    removed that are not listed again; a TE missing here went down for a
    reason this CM does not know."""
    term: int = 0
    """The head term of the CM's node (supervisor/head_terms.py): a standby that
    takes over starts a higher one. 0: a single node (no term)."""


FromClusterManager = TEList | TEReport | ScaleEvent | TierReport


class TermFence:
    """A reader of the heads' TE lists (several heads: one list per head) keeps
    only the newest term's: a list of a term below the highest seen is a
    deposed head's (a partition left it serving) and is ignored, as a list
    with is_complete = False is. Other messages pass."""

    def __init__(self, term: int = 0):
        self.highest = term
        self.num_fenced = 0

    def admits(self, msg) -> bool:
        if not isinstance(msg, TEList):
            return True
        if msg.term < self.highest:
            self.num_fenced += 1
            return False
        self.highest = msg.term
        return True
