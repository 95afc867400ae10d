"""The gateway's OpenAPI document and its pages: /openapi.json, /docs, /redoc.

FastAPI derives the request bodies from gateway/http/schemas.py; this module adds
what it cannot see, so a schema-driven client or fuzzer knows every answer:

    200 models          the shapes gateway/http/responses.py builds (documentation
                        only: handlers return Responses, nothing is re-validated)
    error statuses      ROUTE_ERRORS: every status each route can answer, each
                        with the OpenAI error body; no 422 (validation is a 400)
    `model`             an enum of the one served model
    with api_keys       a bearer security scheme and 401 on every operation but
                        /health; the three pages themselves need a valid key

Unsupported methods are answered 405 with an `Allow` header (gateway/errors.py);
they are not operations, so the document does not list them.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.responses import HTMLResponse, JSONResponse

from deepserve.gateway.config import GatewayConfig

OPENAPI_URL, DOCS_URL, REDOC_URL = "/openapi.json", "/docs", "/redoc"
PUBLIC_PATHS = frozenset({"/health"})
"""Operations served without a key even when api_keys are set."""

_GENERATION = (400, 404, 413, 429, 500, 503, 504)
ROUTE_ERRORS: dict[str, tuple[int, ...]] = {
    # 400 invalid body / prompt too long, 404 unknown model, 413 body too large,
    # 429 too many open requests, 500 a request that crashed engines or a bug,
    # 503 no engine could serve it, 504 past request_timeout_s
    "/v1/chat/completions": _GENERATION,
    "/v1/completions": _GENERATION,
    # contexts: 404 unknown model or context (another tenant's included), 429 too many
    # contexts of the tenant, 507 the contexts' KV budget is full
    "/v1/contexts": (400, 404, 413, 429, 500, 503, 504, 507),
    "/v1/contexts/{context_id}": (404, 413, 500, 503, 504),
    "/v1/models": (413, 500),
    "/v1/models/{model}": (404, 413, 500),
    # 400 invalid body / too long / an id past the vocabulary, 404 unknown model
    "/tokenize": (400, 404, 413, 500),
    "/detokenize": (400, 404, 413, 500),
    "/version": (413, 500),
    "/health": (413, 500, 503),
    "/metrics": (413, 500),
}
"""Error statuses per path (401 comes on top with api_keys). 413: the body
limit sits in front of every route, a GET with a body included."""
_DESCRIPTIONS = {400: "Invalid request", 401: "Missing or unknown API key",
                 404: "Unknown model", 413: "Request body too large",
                 429: "Too many open requests", 500: "Internal error",
                 503: "No engine available", 504: "Request timed out",
                 507: "No room for the context's KV"}


# -- response models: documentation of gateway/http/responses.py -----------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error answer: the OpenAI error object."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    """stream=false; with stream=true: text/event-stream of chat.completion.chunk."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(BaseModel):
    """stream=false; with stream=true: text/event-stream of text_completion chunks."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str


class ContextObject(BaseModel):
    """expires_at, created: Unix seconds."""

    id: str
    object: Literal["context"]
    model: str
    tokens: int
    expires_at: int
    created: int


class ContextDeleted(BaseModel):
    id: str
    object: Literal["context.deleted"]
    deleted: bool


_MODELS = (ErrorBody, ChatCompletion, Completion, ModelCard, ModelList, Health, ContextObject,
           ContextDeleted, TokenizeResponse, DetokenizeResponse, Version)
_REF = "#/components/schemas/{model}"
_SSE = {"text/event-stream": {"schema": {  # one event (OpenAPI 3.1: `schema` is per event)
    "type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "description": "a JSON chunk, or an error body after a failure; "
                                         "the last event's data is [DONE]"}}}}}
_OK = {"/v1/chat/completions": ({"application/json": ChatCompletion} | _SSE),
       "/v1/completions": ({"application/json": Completion} | _SSE),
       "/v1/models": {"application/json": ModelList},
       "/v1/models/{model}": {"application/json": ModelCard},
       "/health": {"application/json": Health},
       "/v1/contexts": {"application/json": ContextObject},
       "/tokenize": {"application/json": TokenizeResponse},
       "/detokenize": {"application/json": DetokenizeResponse},
       "/version": {"application/json": Version},
       "/metrics": {"text/plain": {"schema": {"type": "string"}}}}


def _content(media: dict[str, Any]) -> dict[str, Any]:
    return {kind: {"schema": {"$ref": _REF.format(model=schema.__name__)}}
            if isinstance(schema, type) else schema for kind, schema in media.items()}


def build_openapi(app: FastAPI, config: GatewayConfig) -> dict[str, Any]:
    """The document of `app`'s routes, completed as the module docstring says."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _, defs = models_json_schema([(m, "serialization") for m in _MODELS], ref_template=_REF)
    schemas.update(defs["$defs"])
    for name in ("ChatCompletionRequest", "CompletionRequest", "ContextCreateRequest",
                 "TokenizeRequest", "DetokenizeRequest"):
        if name in schemas:
            schemas[name]["properties"]["model"] = {"type": "string", "title": "Model",
                                                    "enum": list(config.served_models)}
    if config.has_auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            _complete(operation, path, config.has_auth)
    return doc


def _complete(operation: dict[str, Any], path: str, has_auth: bool) -> None:
    responses = operation["responses"]
    responses.pop("422", None)
    if path in _OK:
        responses["200"] = {"description": "Successful Response", "content": _content(_OK[path])}
    elif path == "/v1/contexts/{context_id}":
        model = ContextDeleted if "delete_" in operation.get("operationId", "") else ContextObject
        responses["200"] = {"description": "Successful Response",
                            "content": _content({"application/json": model})}
    statuses = set(ROUTE_ERRORS.get(path, (413, 500)))
    if has_auth and path not in PUBLIC_PATHS:
        statuses.add(401)
        operation["security"] = [{"bearer": []}]
    for status in sorted(statuses):
        responses[str(status)] = {"description": _DESCRIPTIONS[status],
                                  "content": _content({"application/json": ErrorBody})}


def install_openapi(app: FastAPI, config: GatewayConfig, auth: Callable[..., Any]) -> None:
    """Serve the document and the two pages, behind `auth` (a key when api_keys
    are set). Create `app` with openapi_url=None so FastAPI's own are not there."""
    document: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not document:  # routes are all added by the first request
            document.update(build_openapi(app, config))
        return document

    async def openapi_json() -> JSONResponse:
        return JSONResponse(openapi())

    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=OPENAPI_URL, title=f"{app.title} - docs")

    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=OPENAPI_URL, title=f"{app.title} - ReDoc")

    app.openapi = openapi
    for url, page in ((OPENAPI_URL, openapi_json), (DOCS_URL, docs), (REDOC_URL, redoc)):
        app.add_api_route(url, page, methods=["GET"], include_in_schema=False,
                          dependencies=[Depends(auth)])
