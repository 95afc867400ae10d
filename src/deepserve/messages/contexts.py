"""Contexts by id and turn records: gateway <-> job executor.

    gateway ──CreateContext / GetContext / DeleteContext──> JE inbox
    JE ──SubmitRequest(pin_context, reply_to = the JE)──> a TE: prefill, pin in the tiers
    TE ──RequestDelta (finished) / RequestFailed──> JE ──ContextInfo / RequestFailed──> gateway
    JE ──ContextUnpin──> kv-cache (deleted or expired: free its blocks on every tier)
    gateway ──TurnDone(request id, output ids or None)──> JE   (token-id continuity,
        control/je/turns.py; None: it failed)
    gateway ──PinTurn(request id)──> JE: that turn ended in tool calls; the JE has a TE
        prefill its ids again (a cache hit) with ContextPin(on_host), held in host
        memory for [node] tool_call_pin_s (control/je/turn_pins.py)

A context belongs to the tenant (salt) that created it: for any other
tenant its id does not exist (context_not_found).
"""

from __future__ import annotations

import msgspec

_STRUCT = dict(tag_field="kind", omit_defaults=True, kw_only=True)


class CreateContext(msgspec.Struct, tag="create_context", **_STRUCT):
    request_id: str
    model: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    ttl_s: float
    salt: str | None = None
    reply_to: str


class GetContext(msgspec.Struct, tag="get_context", **_STRUCT):
    request_id: str
    context_id: str
    salt: str | None = None
    reply_to: str


class DeleteContext(msgspec.Struct, tag="delete_context", **_STRUCT):
    request_id: str
    context_id: str
    salt: str | None = None
    reply_to: str


class ContextInfo(msgspec.Struct, tag="context_info", **_STRUCT):
    """JE -> gateway: the context (created, looked up, or just deleted)."""

    request_id: str
    context_id: str
    model: str
    num_tokens: int
    expires_at: float  # time.time()
    created_at: float = 0.0
    deleted: bool = False


class TurnDone(msgspec.Struct, tag="turn_done", **_STRUCT):
    """Gateway -> JE: a chat request's sub-request ended: it completed with these
    output ids, or (None) it failed, and its prompt is no turn."""

    request_id: str
    output_ids: list[int] | None


class PinTurn(msgspec.Struct, tag="pin_turn", **_STRUCT):
    """Gateway -> JE, after that sub-request's TurnDone: its reply ended in tool
    calls, so its caller comes back with the tools' results (keep its KV near)."""

    request_id: str
