"""Contexts by id: POST /v1/contexts, GET and DELETE /v1/contexts/{id}.

    POST {"model", "messages" | "prompt", "ttl_s"} ──CreateContext──> JE: a TE
        prefills it and pins its KV in the node's tiers ──> 200
        {"id": "ctx-…", "object": "context", "model", "tokens", "expires_at", "created"}
    GET    ──GetContext──>    the same object, or 404 context_not_found
    DELETE ──DeleteContext──> {"id", "object": "context.deleted", "deleted": true}, or 404

"context_id" on /v1/chat/completions (its messages come first) or
/v1/completions (its prompt comes first) uses one; the response's
usage.prompt_tokens_details.cached_tokens shows the hit. A context is its
tenant's: another tenant's GET, DELETE or use of its id is a 404. Past the
contexts' KV budget creation is a 507, past a tenant's count a 429.
"""

from __future__ import annotations

import re
import uuid

from fastapi import APIRouter, Depends, Request

from deepserve.gateway.http.auth import state_of, tenant_of
from deepserve.gateway.errors import APIError
from deepserve.gateway.http.schemas import ContextCreateRequest
from deepserve.messages.contexts import ContextInfo, CreateContext, DeleteContext, GetContext
from deepserve.messages.engine import RequestFailed

router = APIRouter()
CONTEXT_ID = re.compile(r"ctx-[0-9a-f]{32}")


@router.post("/v1/contexts", response_model=None)
async def create_context(body: ContextCreateRequest, request: Request,
                         tenant: str = Depends(tenant_of)) -> dict:
    state = state_of(request)
    if body.model not in state.config.served_models:
        raise APIError.model_not_found(body.model)
    msg = CreateContext(request_id=_call_id(), model=body.model, ttl_s=body.ttl_s, salt=tenant,
                        reply_to=state.config.reply_address,
                        **body.wire_input(state.config.max_prompt_chars))
    return _answer(await state.client.call(msg, state.config.request_timeout_s))


@router.get("/v1/contexts/{context_id}", response_model=None)
async def get_context(context_id: str, request: Request, tenant: str = Depends(tenant_of)) -> dict:
    return await _by_id(GetContext, context_id, request, tenant)


@router.delete("/v1/contexts/{context_id}", response_model=None)
async def delete_context(context_id: str, request: Request,
                         tenant: str = Depends(tenant_of)) -> dict:
    return await _by_id(DeleteContext, context_id, request, tenant)


async def _by_id(kind, context_id: str, request: Request, tenant: str) -> dict:
    state = state_of(request)
    _check_id(context_id)
    msg = kind(request_id=_call_id(), context_id=context_id, salt=tenant,
               reply_to=state.config.reply_address)
    return _answer(await state.client.call(msg, 30.0))


def _call_id() -> str:
    return f"ctxcall-{uuid.uuid4().hex}"


def _check_id(context_id: str) -> None:
    if not CONTEXT_ID.fullmatch(context_id):
        raise APIError(404, f"No context with id {context_id[:80]!r}.", "invalid_request_error",
                       "context_id", "context_not_found")


def _answer(reply) -> dict:
    if isinstance(reply, RequestFailed):
        raise APIError.from_failure(reply.error, reply.message, reply.param)
    if not isinstance(reply, ContextInfo):
        raise APIError(500, "The server had an error while processing the request.",
                       "server_error", None, "internal_error")
    if reply.deleted:
        return {"id": reply.context_id, "object": "context.deleted", "deleted": True}
    return {"id": reply.context_id, "object": "context", "model": reply.model,
            "tokens": reply.num_tokens, "expires_at": int(reply.expires_at),
            "created": int(reply.created_at)}
