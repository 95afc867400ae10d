"""The gateway's cap on open requests, shared among the tenants holding them.

    JobClient.submit ──admits(open by tenant, tenant, n, max_open_requests)──> or 429

max_open_requests bounds what one gateway holds (reply queues, routes).
Counted over all tenants alone, one tenant's flood fills it and every other
tenant's next request is refused: the flood starves them at the door, before
the job executor's fair queue ever sees them. So under the cap every request
is admitted, and at the cap a tenant is still admitted while it holds fewer
than an equal share of the cap among the tenants holding open requests
(itself included). The flooding tenant, past its share, gets the 429s. The
gateway then holds at most about twice the cap. Equal shares, not weights:
the weights order the JE's queue (control/je/fair_share.py); this is only
the door. Pure function.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Protocol


class OpenStream(Protocol):
    tenant: str
    request_ids: list[str]
    is_closed: bool


def open_by_tenant(streams: Iterable[OpenStream]) -> Counter[str]:
    """Sub-requests of the streams not closed yet, by tenant (n counts n)."""
    open_by: Counter[str] = Counter()
    for stream in list(streams):
        if not stream.is_closed:
            open_by[stream.tenant] += len(stream.request_ids)
    return open_by


def admits(open_by_tenant: Mapping[str, int], tenant: str, num: int, cap: int) -> bool:
    """May `tenant` open `num` more sub-requests (n counts n)?"""
    if sum(open_by_tenant.values()) + num <= cap:
        return True
    active = {t for t, count in open_by_tenant.items() if count > 0} | {tenant}
    return open_by_tenant.get(tenant, 0) + num <= cap / len(active)
