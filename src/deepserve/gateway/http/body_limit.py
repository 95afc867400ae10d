"""BodyLimit: an ASGI guard that answers 413 to a request body over the limit.

It sits in front of the app, so an oversized body is refused before FastAPI
reads or parses it and before any authentication work:

    Content-Length > limit           413 at once, the body is never read
    no Content-Length (chunked)      bytes are counted as the app reads them;
                                     past the limit the read raises
                                     BodyTooLarge, which the app's error
                                     handlers answer (413) like any APIError
"""

from __future__ import annotations

from starlette.exceptions import HTTPException

from deepserve.gateway.errors import APIError, error_response


class BodyTooLarge(APIError, HTTPException):
    """413, raised inside `receive` once the body has passed the limit. An
    HTTPException too, so FastAPI's body reader lets it through unchanged
    instead of turning it into a 400 "error parsing the body"."""

    def __init__(self, limit: int):
        message = f"The request body is larger than {limit} bytes."
        APIError.__init__(self, 413, message, "invalid_request_error", None,
                          "request_too_large")
        self.status_code, self.detail, self.headers = 413, message, None


class BodyLimit:
    """ASGI middleware: HTTP request bodies of at most `max_body_bytes`."""

    def __init__(self, app, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await error_response(BodyTooLarge(limit))(scope, receive, send)
            return
        num_bytes = 0
        started = False

        async def counted_receive():
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > limit:
                    raise BodyTooLarge(limit)
            return message

        async def noting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, noting_send)
        except BodyTooLarge as exc:  # read outside the app's handlers
            if started:
                raise
            await error_response(exc)(scope, receive, send)


def _content_length(scope) -> int | None:
    """The declared Content-Length; None when absent or not a number (the
    server rejects a malformed one itself)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
