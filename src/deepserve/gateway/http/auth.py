"""Who is calling: the tenant of a request's API key, and the app's shared state."""

from __future__ import annotations

import hmac

from fastapi import Request

from deepserve.gateway.errors import APIError
from deepserve.gateway.http.generation import GatewayState

DEFAULT_TENANT = "default"


def state_of(request: Request) -> GatewayState:
    return request.app.state.gateway


def tenant_of(request: Request) -> str:
    """The caller's tenant from `Authorization: Bearer KEY`; 401 if keys are
    configured and the key is missing or unknown. The tenant is the salt."""
    keys = state_of(request).config.api_keys
    if not keys:
        return DEFAULT_TENANT
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    key = key.strip().encode()
    if scheme.lower() != "bearer" or not key:
        raise APIError.unauthorized("Missing API key: send 'Authorization: Bearer KEY'.")
    tenant = None
    for known, name in keys.items():  # compare with every key, in constant time each
        if hmac.compare_digest(known.encode(), key):
            tenant = name
    if tenant is None:
        raise APIError.unauthorized()
    return tenant
