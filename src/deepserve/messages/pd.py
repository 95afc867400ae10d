"""Prefill/decode disaggregation: the messages of one disaggregated job.

    JE ──SubmitRequest(prefill_from=P's inbox)──> D tokenizer ──AddRequest──> D master
    D master: allocate blocks for the prompt (its own prefix-cache hits stay)
    D master ──PrefillOrder──> [P master's PD socket]: prefill (max_tokens 1)
    P workers ══ DistFlow: P's blocks -> D's pool (after the forward, or layer by layer) ══
    P workers ──KVSent (each rank)──> P master
    P master ──KVReady(first token | error)──> [D master's PD socket]: adopt, decode
    D master ──KVAck──> [P master's PD socket]: free its copy
    D master ──CancelOrder──> [P master's PD socket]: the order was dropped (abort,
                               timeout): stop, answer KVReady(error="cancelled")

Masters talk to each other directly: each binds a PULL socket for ToPeer at
pd_address(its TE's inbox), so a TE is still named by one address (the
inbox the JE knows) and no tokenizer relays PD messages. order_id names one
PrefillOrder (one attempt of a request): a late KVReady or KVAck of an
earlier attempt never touches a later one's blocks.

The prefill TE also frees its copy when no KVAck comes within the transfer
timeout (the decode TE died), so no KV stays pinned. The caller's stream
comes from the decode TE alone.

Block ownership: an order's destination blocks belong to the order until the
prefill TE can no longer write them. A decode TE that drops an order sends
CancelOrder and keeps the blocks (fenced, no request owns them) until a
KVReady of that order says the prefill side is done — it answers a cancel at
once when no transfer was dispatched, or after every rank's KVSent — or a
transfer timeout passes (a dead prefill TE writes nothing). So a prefill TE
never writes into blocks that another request (or tenant) holds by then.
"""

from __future__ import annotations

import msgspec

from deepserve.messages.sampling import SamplingParams

_STRUCT = dict(tag_field="kind", omit_defaults=True, kw_only=True)


def pd_address(inbox: str) -> str:
    """The address a TE's master takes peer PD messages at, from the TE's
    inbox: ipc://DIR/te1.sock -> ipc://DIR/te1.pd.sock; tcp://H:P -> tcp://H:P+1."""
    scheme, sep, rest = inbox.partition("://")
    if scheme == "ipc" and sep:
        stem = rest[:-len(".sock")] if rest.endswith(".sock") else rest
        return f"ipc://{stem}.pd.sock"
    if scheme == "tcp" and sep:
        host, colon, port = rest.rpartition(":")
        if colon and port.isdigit():
            return f"tcp://{host}:{int(port) + 1}"
    raise ValueError(f"no PD address for inbox {inbox!r} (ipc://PATH or tcp://HOST:PORT)")


class KVEndpoint(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Where one rank's KV pool can be reached: its shared-memory segment
    (same node) and/or a DistFlow receiver's address (tcp, ring)."""

    shape: tuple[int, ...]
    dtype: str
    shm: str | None = None
    tcp: str | None = None


class KVStream(msgspec.Struct, kw_only=True, frozen=True):
    """DualPath's decode read path across hosts: the decode TE read these
    blocks of the prompt from its storage and serves them as a layer stream
    (transfer/layer_stream.py) the prefill TE pulls during its forward."""

    address: str
    stream_id: int
    hashes: list[int]  # the blocks' hashes, rows 0.. of the stream, in prompt order


class PrefillOrder(msgspec.Struct, tag="prefill_order", **_STRUCT):
    """Decode TE -> prefill TE: compute this prompt's KV and write blocks
    skip_blocks.. of it into dst_block_ids of my pool (one endpoint per rank).
    sampling: resolved by the decode TE (no field unset), so the prefill TE
    samples the first token exactly as the decode TE samples the rest."""

    request_id: str
    order_id: int = 0  # unique per decode master: KVReady and KVAck echo it
    prompt_token_ids: list[int]
    sampling: SamplingParams
    salt: str | None = None
    skip_blocks: int
    dst_block_ids: list[int]
    dst_te: str
    dst_endpoints: list[KVEndpoint]
    reply_to: str  # the decode master's PD address
    kv_stream: KVStream | None = None  # DualPath: hit blocks the decode TE read for us


class KVReady(msgspec.Struct, tag="kv_ready", **_STRUCT):
    """Prefill TE -> decode TE: the blocks are in your pool, and the first
    token is this one; or the prefill or the transfer failed (error set)."""

    request_id: str
    order_id: int = 0
    token_id: int = -1
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    cached_tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    reply_to: str = ""  # the prefill master's PD address, for the KVAck
    is_retryable: bool = True  # False: the request itself failed (retrying fails again)
    code: str | None = None  # the prefill TE refused the request: InvalidRequestError.code


class KVAck(msgspec.Struct, tag="kv_ack", **_STRUCT):
    """Decode TE -> prefill TE: done with your copy (adopted, or not wanted)."""

    request_id: str
    order_id: int = 0


class CancelOrder(msgspec.Struct, tag="cancel_order", **_STRUCT):
    """Decode TE -> prefill TE: I dropped this order (the request was aborted or
    its KV timed out); stop it and answer KVReady(error="cancelled") once no
    write into my blocks can happen any more."""

    request_id: str
    order_id: int = 0


ToPeer = PrefillOrder | KVReady | KVAck | CancelOrder  # what a master's PD socket takes


class FailRequest(msgspec.Struct, tag="fail_request", **_STRUCT):
    """Master -> its tokenizer: end this request with an error the caller sees."""

    request_id: str
    error: str
    message: str


class KVTransferOrder(msgspec.Struct, array_like=True, omit_defaults=True):
    """Master -> workers, inside a StepBatch: after (or, layerwise, during)
    this step's forward, send blocks src_block_ids of seq_id to dst_block_ids
    of peer dst_te (rank r uses dst_endpoints[r])."""

    seq_id: int
    dst_te: str
    dst_endpoints: list[KVEndpoint]
    src_block_ids: list[int]
    dst_block_ids: list[int]
    layerwise: bool = False


class KVSent(msgspec.Struct, tag="kv_sent", **_STRUCT):
    """Worker -> master: one rank's part of a KVTransferOrder is done (or failed)."""

    rank: int
    seq_id: int
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None
