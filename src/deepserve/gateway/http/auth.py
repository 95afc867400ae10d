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
    return _caller(request)[0]


def metrics_tenant(request: Request) -> str | None:
    """Whose per-tenant series /metrics shows the caller: None (every tenant's)
    on a node without api_keys or for an admin key, else the key's tenant only;
    401 as tenant_of."""
    tenant, key = _caller(request)
    if key is None or key in state_of(request).config.admin_keys:
        return None
    return tenant


def _caller(request: Request) -> tuple[str, str | None]:
    """(tenant, the configured key that matched); (DEFAULT_TENANT, None) without keys."""
    keys = state_of(request).config.api_keys
    if not keys:
        return DEFAULT_TENANT, None
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    key = key.strip().encode()
    if scheme.lower() != "bearer" or not key:
        raise APIError.unauthorized("Missing API key: send 'Authorization: Bearer KEY'.")
    matched = None
    for known in keys:  # compare with every key, in constant time each
        if hmac.compare_digest(known.encode(), key):
            matched = known
    if matched is None:
        raise APIError.unauthorized()
    return keys[matched], matched
