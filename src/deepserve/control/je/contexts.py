"""ContextBook: the job executor's registry of contexts by id (pure, plus a file).

    POST /v1/contexts ──CreateContext──> JE: tokenize, begin() ──> a TE prefills and pins
        TE's last delta ──finish()──> registered (its prompt ids, text, messages, expiry)
    GET / DELETE /v1/contexts/{id}, "context_id" on a request ──get(id, tenant)──> it, or None
    every step ──expire(now)──> ids whose pins the tier service drops (ContextUnpin)

A context is the tenant's alone: get() with any other tenant finds nothing
(the HTTP side answers 404, never 403: an id of another tenant does not
exist for the caller). At most max_per_tenant live contexts per tenant
(creation past it: 429); the bytes they pin are bounded by the tier service
([node] context_cache_bytes: past it, 507).

The registry is written to `path` (JSON, atomically) on every change, so a
restarted job executor knows the contexts its predecessor made; their blocks
stayed pinned in the tier service meanwhile (it expires them itself too).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from deepserve.private_files import write_private

log = logging.getLogger(__name__)
MAX_PER_TENANT = 64
MIN_TTL_S, MAX_TTL_S = 1.0, 7 * 24 * 3600.0


@dataclass
class Context:
    context_id: str
    tenant: str | None
    model: str
    prompt_token_ids: list[int]
    text: str | None  # the rendered prompt (chat: without a generation prompt)
    messages: list[dict] | None  # chat contexts: these messages come first
    expires_at: float  # time.time()
    created_at: float = field(default_factory=time.time)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


class ContextBook:
    def __init__(self, path: str | Path | None = None, max_per_tenant: int = MAX_PER_TENANT,
                 clock: Callable[[], float] = time.time):
        self.path = Path(path) if path else None
        self.max_per_tenant, self.clock = max_per_tenant, clock
        self.contexts: dict[str, Context] = {}
        self.creating: dict[str, Context] = {}  # context id -> not yet pinned
        self._load()

    def new_id(self) -> str:
        return f"ctx-{uuid.uuid4().hex}"

    def can_create(self, tenant: str | None) -> bool:
        live = [c for c in (*self.contexts.values(), *self.creating.values())
                if c.tenant == tenant]
        return len(live) < self.max_per_tenant

    def begin(self, ctx: Context) -> None:
        self.creating[ctx.context_id] = ctx

    def finish(self, context_id: str, ok: bool) -> Context | None:
        """The creation ended: registered (ok) or forgotten; the context, if it was begun."""
        ctx = self.creating.pop(context_id, None)
        if ctx is not None and ok:
            self.contexts[context_id] = ctx
            self._save()
        return ctx

    def get(self, context_id: str, tenant: str | None) -> Context | None:
        ctx = self.contexts.get(context_id)
        if ctx is None or ctx.tenant != tenant or ctx.expires_at <= self.clock():
            return None
        return ctx

    def delete(self, context_id: str, tenant: str | None) -> Context | None:
        ctx = self.get(context_id, tenant)
        if ctx is not None:
            del self.contexts[context_id]
            self._save()
        return ctx

    def expire(self) -> list[str]:
        now = self.clock()
        gone = [c for c, ctx in self.contexts.items() if ctx.expires_at <= now]
        for context_id in gone:
            del self.contexts[context_id]
        if gone:
            self._save()
        return gone

    # -- the file ----------------------------------------------------------------------
    def _save(self) -> None:
        if self.path is None:
            return
        try:  # owner-only (prompts), a temp file of its own (standby heads share the dir)
            write_private(self.path, json.dumps([asdict(c) for c in self.contexts.values()])
                          .encode())
        except OSError as e:  # the registry still serves from memory
            log.error("cannot write the context registry %s: %s", self.path, e)

    def _load(self) -> None:
        if self.path is None or not self.path.is_file():
            return
        try:
            entries = json.loads(self.path.read_text())
            for entry in entries:
                ctx = Context(**entry)
                self.contexts[ctx.context_id] = ctx
        except (OSError, ValueError, TypeError) as e:
            log.error("context registry %s unreadable (%s): starting empty", self.path, e)
            self.contexts = {}
