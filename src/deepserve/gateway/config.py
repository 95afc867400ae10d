"""GatewayConfig: what one gateway process needs, frozen after construction.

In a node it is the gateway's part of the node's resolved config (from_node):
[node] host / port / served_model, every [gateway] key, the run's addresses,
and each served model's directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Mapping

import msgspec

from deepserve.config.node import NodeConfig, check_admin_keys

API_KEYS_ENV = "DEEPSERVE_API_KEYS"


@dataclass(frozen=True)
class GatewayConfig:
    je_address: str
    """ZeroMQ address the job executor PULLs SubmitRequest / AbortRequest on
    (the gateway connects a PUSH socket to it)."""
    cm_address: str
    """ZeroMQ address of the cluster manager's PUB socket (TEList, TEReport);
    the gateway connects a SUB socket to it."""
    reply_address: str
    """ZeroMQ address the gateway binds its one PULL socket on; every
    SubmitRequest names it as reply_to (RequestDelta / RequestFailed)."""
    host: str = "127.0.0.1"
    """Interface the HTTP server listens on."""
    port: int = 8000
    """TCP port of the HTTP server (0: any free port)."""
    served_model: str = "deepserve"
    """The first model name /v1/models shows and `model` accepts."""
    models: tuple[str, ...] = ()
    """Every other model name served (listed and accepted like served_model)."""
    scalable_models: tuple[str, ...] = ()
    """Models the autoscaler starts on demand: a request for one with no TE
    waits for one to start instead of being refused."""
    model_dirs: Mapping[str, str] = field(default_factory=dict)
    """Served model name -> its directory: the gateway's own tokenizer of it
    (/tokenize, /detokenize) and its config.json (max_model_len while no TE
    of it runs). A model not named here cannot be tokenized at the gateway."""
    api_keys: Mapping[str, str] = field(default_factory=dict)
    """API key -> tenant name. Empty: no authentication, every caller is the
    tenant "default". The tenant name is the prefix-cache salt."""
    admin_keys: tuple[str, ...] = ()
    """API keys (each one of api_keys) whose callers read every tenant's series
    on /metrics; any other key's caller sees its own tenant's only. With no
    api_keys, /metrics shows everything to everyone."""
    max_open_requests: int = 256
    """Sub-requests (n counts n) open at once; past it: 429 for a tenant that
    holds its equal share of it or more (link/open_share.py: a flood cannot
    shut the others out; at most about twice this many are open)."""
    request_timeout_s: float = 600.0
    """Seconds from admission to the last token; past it the request is
    aborted and answered with an error (504, or an error event mid-stream)."""
    max_prompt_chars: int = 1_000_000
    """Characters (or token ids) of prompt / messages content at most; past
    it: 400 context_length_exceeded, before anything is sent to a TE."""
    default_max_tokens: int | None = None
    """max_tokens when a request gives neither max_tokens nor max_completion_tokens.
    None: unset, so the TE resolves it: the model's max_new_tokens
    (generation_config.json) capped by the rest of the context, else all of
    the rest (max_model_len - prompt tokens), as vLLM does."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Bytes of an HTTP request body at most; past it: 413 with an OpenAI error
    body, answered before the body is read or parsed and before authentication
    (gateway/http/body_limit.py)."""
    max_connections: int = 1024
    """HTTP connections open at once at most; one past it is answered 503 with
    an OpenAI error body and closed (gateway/http/connection_guard.py)."""
    read_timeout_s: float = 15.0
    """Seconds a connection has to send a whole request (head and body) from
    when it opened or its previous response ended; past it the connection is
    closed: half-open, slow-header and slow-body clients hold nothing for long."""
    write_timeout_s: float = 30.0
    """Seconds response bytes may wait unread by the client (the server's send
    buffer not drained); past it the connection is cut off and the request's
    sub-requests aborted, so a client that stops reading frees its TE slots."""
    max_queued_replies: int = 1024
    """Replies (token deltas) one request may have waiting for its HTTP writer;
    past it the client counts as not reading: its sub-requests are aborted and
    its stream ends with an error (gateway/link/reply_stream.py)."""

    def __post_init__(self):
        for name in ("je_address", "cm_address", "reply_address", "served_model", "host"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_open_requests", "max_prompt_chars", "default_max_tokens",
                     "max_body_bytes", "max_connections", "max_queued_replies"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "read_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for key, tenant in self.api_keys.items():
            if not key or not tenant or not isinstance(key, str) or not isinstance(tenant, str):
                raise ValueError("api_keys must map non-empty key strings to tenant names")
        object.__setattr__(self, "admin_keys", tuple(self.admin_keys))
        check_admin_keys(self.admin_keys, self.api_keys)
        object.__setattr__(self, "api_keys", MappingProxyType(dict(self.api_keys)))
        object.__setattr__(self, "model_dirs", MappingProxyType(dict(self.model_dirs)))

    @property
    def served_models(self) -> tuple[str, ...]:
        return (self.served_model, *[m for m in self.models if m != self.served_model])

    @property
    def has_auth(self) -> bool:
        return bool(self.api_keys)

    @classmethod
    def from_node(cls, config: NodeConfig) -> "GatewayConfig":
        """The gateway's part of a node's resolved config (its `run` set)."""
        run, node = config.run, config.node
        names = list(config.served_models)
        return cls(je_address=run.je, cm_address=run.cm_pub, reply_address=run.gw_reply,
                   host=node.host, port=node.port, served_model=names[0],
                   models=tuple(names[1:]), model_dirs=config.served_models,
                   scalable_models=tuple(m.name for m in config.all_models if m.scalable),
                   **msgspec.structs.asdict(config.gateway))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs) -> "GatewayConfig":
        """Build from keyword arguments; `api_keys` also takes DEEPSERVE_API_KEYS
        ("key1:tenantA,key2:tenantB") when it is set (keys given here win)."""
        environ = os.environ if environ is None else environ
        keys = parse_api_keys(environ.get(API_KEYS_ENV, ""))
        keys.update(kwargs.pop("api_keys", None) or {})
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown GatewayConfig fields: {sorted(unknown)}")
        return cls(api_keys=keys, **kwargs)


def parse_api_keys(text: str) -> dict[str, str]:
    """"key1:tenantA,key2:tenantB" -> {"key1": "tenantA", "key2": "tenantB"}."""
    keys: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, tenant = item.rpartition(":")
        if not sep or not key or not tenant:
            raise ValueError(f"{API_KEYS_ENV}: expected KEY:TENANT, got {item!r}")
        keys[key] = tenant
    return keys
