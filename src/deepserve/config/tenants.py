"""[tenants]: each tenant's share of the engines and its limits (conf/node.toml).

A tenant is the name `[gateway] api_keys` maps an API key to ("default"
without keys). The job executor queues requests per tenant when the
engines are full and releases them in weighted fair order
(control/je/fair_queue.py); it refuses (HTTP 429) a request that would take
its tenant past max_requests or max_tokens. Every key holds for every
tenant; a [tenants.named.NAME] table overrides them for one tenant:

    [tenants]
    weight = 1.0            # every tenant's share, relative
    max_requests = 0        # sub-requests queued or running per tenant; 0: no limit
    max_tokens = 0          # prompt + max_tokens of those; 0: no limit
    retry_after_s = 1       # Retry-After of a 429

    [tenants.named.tenant-a]
    weight = 4.0
    max_requests = 64

The defaults (weight 1, no limits) leave a single tenant as it was.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from deepserve.messages.engine import TenantWeight as Weight  # what a TE is sent

Limit = Annotated[int, Meta(ge=0)]


class TenantSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One tenant's overrides ([tenants.named.NAME]); None: the [tenants] value."""

    weight: Weight | None = None
    """Its share of the engines, relative to the other tenants' weights."""
    max_requests: Limit | None = None
    """Its sub-requests queued or running at once at most (n counts n); 0: no limit."""
    max_tokens: Limit | None = None
    """Prompt tokens + max_tokens of those at most; 0: no limit."""


class TenantLimits(msgspec.Struct, frozen=True):
    """One tenant's resolved share and limits (0: no limit)."""

    weight: float
    max_requests: int
    max_tokens: int


class TenantsSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    weight: Weight = 1.0
    """Every tenant's share of the engines when they are full (relative)."""
    max_requests: Limit = 0
    """Sub-requests one tenant may have queued or running at once (n counts n);
    one more is answered 429. 0: no limit."""
    max_tokens: Limit = 0
    """Tokens one tenant may have in flight: prompt tokens + max_tokens of its
    queued and running sub-requests (one without max_tokens counts the rest of
    the model's context); one more past it is answered 429. 0: no limit."""
    retry_after_s: Annotated[int, Meta(ge=1, le=3600)] = 1
    """Seconds a 429 for a tenant limit tells the caller to wait (Retry-After)."""
    named: dict[str, TenantSection] = {}
    """Tenant name -> its own weight / limits ([tenants.named.NAME])."""

    def limits(self, tenant: str) -> TenantLimits:
        own = self.named.get(tenant) or TenantSection()
        return TenantLimits(
            weight=own.weight if own.weight is not None else self.weight,
            max_requests=own.max_requests if own.max_requests is not None else self.max_requests,
            max_tokens=own.max_tokens if own.max_tokens is not None else self.max_tokens)

    def check_names(self, tenants: set[str]) -> None:
        """ValueError naming a [tenants.named] table no API key leads to (a typo
        would silently give that tenant the defaults); tenants: the names of
        [gateway] api_keys, empty when it has none (then every tenant is "default")."""
        known = tenants or {"default"}
        for name in self.named:
            if name not in known:
                raise ValueError(f"tenants: named.{name}: no [gateway] api_keys entry names "
                                 f"tenant {name!r}; known: {', '.join(sorted(known))}")
