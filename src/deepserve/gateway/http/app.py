"""The gateway's HTTP app (OpenAI API); gateway/http/server.py runs it under uvicorn.

    POST /v1/chat/completions, /v1/completions   auth -> validate -> generation.generate
    GET  /v1/models, /v1/models/{model}           the served models, with max_model_len
    POST /tokenize, /detokenize                   a model's token ids (gateway/http/tokenize.py)
    GET  /version                                 {"version": DeepServe's version}
    POST /v1/contexts, GET|DELETE /v1/contexts/{id}  contexts by id (gateway/http/contexts.py)
    GET  /health                                  200 while the CM lists >= 1 TE, else 503
    GET  /metrics                                 Prometheus text of the gateway's registry
    GET  /openapi.json, /docs, /redoc             the API's description (gateway/http/openapi.py)

With api_keys set, everything but /health needs a valid key: /metrics and the
API description are not served to anonymous callers, and /metrics shows the
per-tenant series (label `tenant`) of the caller's own tenant only unless the
key is one of admin_keys.

The JobClient (ZeroMQ sockets, two receiver tasks) starts and stops with the
app's lifespan, on the server's event loop.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from contextlib import asynccontextmanager
from typing import Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.responses import Response

from deepserve.gateway.http import contexts, tokenize
from deepserve.gateway.http.auth import state_of as _state
from deepserve.gateway.http.auth import metrics_tenant, tenant_of
from deepserve.gateway.http.body_limit import BodyLimit
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.errors import APIError, error_response, install_error_handlers
from deepserve.gateway.http.generation import GatewayState, generate
from deepserve.gateway.link.job_client import JobClient
from deepserve.gateway.metrics import CONTENT_TYPE, GatewayMetrics, RequestCounter
from deepserve.gateway.http.openapi import install_openapi
from deepserve.gateway.http.schemas import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

router = APIRouter()


def _version() -> str:
    try:
        return importlib.metadata.version("deepserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"


VERSION = _version()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           tenant: str = Depends(tenant_of)) -> Response:
    return await generate(request, _state(request), body, tenant)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request,
                      tenant: str = Depends(tenant_of)) -> Response:
    return await generate(request, _state(request), body, tenant)


@router.get("/v1/models", dependencies=[Depends(tenant_of)])
async def list_models(request: Request) -> dict:
    models = _state(request).config.served_models
    return {"object": "list", "data": [_model_card(request, m) for m in models]}


@router.get("/v1/models/{model:path}", dependencies=[Depends(tenant_of)])
async def get_model(model: str, request: Request) -> dict:
    if model not in _state(request).config.served_models:
        raise APIError.model_not_found(model)
    return _model_card(request, model)


def _model_card(request: Request, model: str) -> dict:
    """Every deployable model, whether or not a TE runs it now (the
    autoscaler starts one on the first request)."""
    max_len = tokenize.tokens_of(request).max_model_len(model, _state(request).client.cluster.tes)
    return {"id": model, "object": "model", "created": request.app.state.created,
            "owned_by": "deepserve", "max_model_len": max_len}


@router.get("/version", dependencies=[Depends(tenant_of)])
async def version() -> dict:
    return {"version": VERSION}



@router.get("/health", response_model=None)
async def health(request: Request) -> Response | dict:
    """200 only while a request sent now can be routed: a job executor is
    linked and the cluster manager lists at least one TE; else 503."""
    client = _state(request).client
    if not client.can_route:
        return error_response(APIError.unavailable("No engine is available."))
    return {"status": "ok", "num_tes": len(client.te_ids)}


@router.get("/metrics")
async def metrics(request: Request, tenant: str | None = Depends(metrics_tenant)) -> Response:
    state = _state(request)
    client = state.client
    state.metrics.refresh(client.num_running, client.num_waiting, client.te_ids, client.reports)
    state.metrics.refresh_models(state.config.served_models, client.cluster.tes)
    state.metrics.refresh_tenants(client.open_by_tenant())
    state.metrics.observe_tiers(client.cluster.tier_report, client.reports)
    return Response(state.metrics.render(tenant), media_type=CONTENT_TYPE)


def create_app(config: GatewayConfig,
               background: Callable[[GatewayState], Awaitable[None]] | None = None) -> FastAPI:
    """The gateway app; its lifespan opens and closes the ZeroMQ side, and
    runs `background` (the heartbeat, gateway/__main__.py) on the server's loop."""
    gateway_metrics = GatewayMetrics()
    client = JobClient(config, gateway_metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.start()
        logger.info("gateway up: JE %s, CM %s, replies on %s", config.je_address,
                    config.cm_address, config.reply_address)
        task = asyncio.create_task(background(app.state.gateway)) if background else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            await client.close()
            app.state.gateway.timeline.close()

    app = FastAPI(title="DeepServe gateway", lifespan=lifespan, openapi_url=None,
                  docs_url=None, redoc_url=None)
    app.state.gateway = GatewayState(config, client, gateway_metrics)
    app.state.created = int(time.time())
    app.state.tokens = tokenize.ModelTokens(config)
    install_error_handlers(app)
    # added first, so it runs inside RequestCounter (a 413 is counted too)
    app.add_middleware(BodyLimit, max_body_bytes=config.max_body_bytes)
    app.add_middleware(RequestCounter, metrics=gateway_metrics)
    app.include_router(router)
    app.include_router(contexts.router)
    app.include_router(tokenize.router)
    install_openapi(app, config, auth=tenant_of)
    return app
