"""OpenAI error bodies, and the handlers that turn every failure into one.

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Every path out of the app that is not a success goes through `error_response`:
APIError (raised by the gateway itself), the DeepServe errors of lower floors,
FastAPI's RequestValidationError (malformed JSON, wrong types, out-of-range
values), Starlette's HTTPException (404 route, 405 method, undecodable body)
and, as a last resort, any other exception (500 with a body, never a bare
traceback page). Bodies are rendered with ensure_ascii so text a client sent
(lone surrogates included) can always be echoed back. An exception's headers
survive (405 keeps its `Allow`, RFC 9110 section 15.5.6).

Tenants never see the platform's insides: a failure of the engine side (a TE
that died, a lost KV transfer, a quarantined request, an unknown error) is
answered with a fixed public message per error code; the JE's or TE's own
message, which names TEs, goes to this process's log only.
"""

from __future__ import annotations

import json
import logging
from typing import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from deepserve.errors import EngineDeadError, InvalidRequestError, PromptTooLongError

logger = logging.getLogger(__name__)

_RETRY = "No engine could complete the request; retry it."
# RequestFailed.error (from the JE or a TE) -> (status, type, code, public message);
# a None message passes the JE's / TE's text on: it is about the caller's own request.
_FAILURES = {
    "invalid_request": (400, "invalid_request_error", None, None),
    "prompt_too_long": (400, "invalid_request_error", "context_length_exceeded", None),
    "invalid_spec": (400, "invalid_request_error", "invalid_spec", None),
    "engine_dead": (503, "service_unavailable", "engine_dead", _RETRY),
    "te_lost": (503, "service_unavailable", "engine_dead", _RETRY),
    "kv_transfer_failed": (503, "service_unavailable", "kv_transfer_failed", _RETRY),
    "context_not_found": (404, "invalid_request_error", "context_not_found", None),
    "too_many_contexts": (429, "rate_limit_error", "too_many_contexts", None),
    # the tenant is at its [tenants] max_requests / max_tokens (control/je/fair_share.py)
    "rate_limited": (429, "rate_limit_error", "rate_limit_exceeded", None),
    "context_over_budget": (507, "insufficient_storage", "context_over_budget",
                            "The KV budget for contexts is full; delete a context or retry "
                            "later."),
    "context_failed": (503, "service_unavailable", "context_failed",
                       "The context could not be stored; retry."),
    # the request crashed two TEs (control/je/job_executor.py): final, never resumed
    "request_crashed_engine": (500, "server_error", "request_crashed_engine",
                               "The request crashed the engine serving it more than once; "
                               "it will not be retried."),
}
_INTERNAL = "The server had an error while processing the request."
_HTTP_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error",
               507: "insufficient_storage"}


class APIError(Exception):
    """An answer the gateway gives on purpose: status + OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None):
        return cls(400, message, "invalid_request_error", param, code)

    @classmethod
    def prompt_too_long(cls, message: str, param: str | None = None):
        return cls(400, message, "invalid_request_error", param, "context_length_exceeded")

    @classmethod
    def unauthorized(cls, message: str = "Incorrect or missing API key."):
        return cls(401, message, "authentication_error", None, "invalid_api_key")

    @classmethod
    def model_not_found(cls, model: str):
        return cls(404, f"The model {model!r} does not exist.", "invalid_request_error",
                   "model", "model_not_found")

    @classmethod
    def overloaded(cls, num_open: int):
        return cls(429, f"Too many open requests ({num_open}); retry later.",
                   "rate_limit_error", None, "too_many_requests")

    @classmethod
    def unavailable(cls, message: str, code: str = "no_engine_available"):
        return cls(503, message, "service_unavailable", None, code)

    @classmethod
    def timeout(cls, timeout_s: float):
        return cls(504, f"The request did not finish within {timeout_s:g} s; it was aborted.",
                   "timeout", None, "request_timeout")

    @classmethod
    def from_failure(cls, error: str, message: str, param: str | None = None,
                     retry_after_s: int = 0):
        """The error a RequestFailed from the JE / a TE stands for; an engine
        failure's message is replaced by a public one (the original is logged);
        retry_after_s > 0 becomes a Retry-After header."""
        status, type_, code, public = _FAILURES.get(error, (500, "server_error", error, _INTERNAL))
        if public is None:
            headers = {"Retry-After": str(retry_after_s)} if retry_after_s > 0 else None
            return cls(status, message, type_, param, code, headers)
        logger.warning("request failed (%s): %s", error, message)
        return cls(status, public, type_, None, code)


def error_response(err: APIError) -> Response:
    content = json.dumps(err.body(), ensure_ascii=True).encode("ascii")
    return Response(content, status_code=err.status, media_type="application/json",
                    headers=dict(err.headers) if err.headers else None)


def from_exception(exc: BaseException) -> APIError:
    """Any exception -> the APIError it is answered with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError.prompt_too_long(str(exc), exc.param)
    if isinstance(exc, InvalidRequestError):
        code = exc.code if exc.code != InvalidRequestError.code else None
        return APIError.bad_request(str(exc), exc.param, code)
    if isinstance(exc, EngineDeadError):
        logger.warning("engine dead: %s", exc)
        return APIError.unavailable(_RETRY, "engine_dead")
    if isinstance(exc, RequestValidationError):
        return _from_validation(exc)
    if isinstance(exc, StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail),
                        _HTTP_TYPES.get(exc.status_code, "invalid_request_error"),
                        headers=exc.headers)
    return APIError(500, _INTERNAL, "server_error", None, "internal_error")


def _from_validation(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError.bad_request("Invalid request body.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError.bad_request(
            f"We could not parse the JSON body of your request: {first.get('ctx', {}).get('error')}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return APIError.bad_request(f"Invalid value for {where!r}: {first.get('msg')}{more}", param)


def _allowed(app: FastAPI, request: Request) -> str:
    """Every method some route serves at this path (Starlette's own matching; a
    path may have several routes, one per method)."""
    allowed = []
    for method in ("GET", "POST", "PUT", "PATCH", "DELETE"):
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] == Match.FULL for route in app.routes):
            allowed.append(method)
    return ", ".join(allowed)


def install_error_handlers(app: FastAPI) -> None:
    async def handle(request: Request, exc: Exception) -> Response:
        err = from_exception(exc)
        if err.status == 405:  # Starlette names the first matching route's methods only
            err.headers = {**(err.headers or {}), "Allow": _allowed(app, request)}
        if err.status >= 500 and not isinstance(exc, APIError):
            logger.error("unhandled error on %s %s", request.method, request.url.path,
                         exc_info=exc)
        return error_response(err)

    for exc_type in (APIError, InvalidRequestError, EngineDeadError, RequestValidationError,
                     StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, handle)
