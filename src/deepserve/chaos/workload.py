"""The chaos run's request mix: seeded, greedy, every request checkable.

    Workload.spec(i) ──random.Random((seed, i))──> RequestSpec
        kind       chat (40 %) · completion (55 %) · hostile (5 %)
        stream     60 % streamed (SSE), else one JSON response
        n          1, or 2 (15 %): each choice must equal the greedy answer
        context    20 % (when the node keeps contexts): the tenant's context
                   by id (POST /v1/contexts at setup) comes first
        tenant     uniform over the node's api_keys (none: one, no auth)
        prompt     uniform over the prompts (chat: over CHATS); the drill's
                   prompts, the long ones past the PD threshold when PD is on
        model      the node's model; with a scaled model (a [[model]] with
                   idle_s), 20 % of the requests without a context go to it in
                   one block of SCALED_BLOCK requests out of SCALED_EVERY, so it
                   idles between its blocks: scaled to zero and back, again
    Workload.request(spec) ──> (path, body | raw bytes, headers)

Every non-hostile request is temperature 0 with logprobs, so its token ids
(drill/stream.py reads them) can be compared with the oracle's answer for its
`key` (checks.py). The oracle asks each key once, streamed, n = 1, as the
first tenant: other tenants, n > 1 and non-streamed requests must all agree.
Hostile requests must get a 4xx with an OpenAI error body (HOSTILE).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

CHATS = (
    ({"role": "user", "content": "Say hi"},),
    ({"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name three colours."}),
    ({"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3 + 3?"}),
)
CONTEXT_PROMPT = "You are a careful assistant. Answer briefly.\n" * 4
CONTEXT_MESSAGES = ({"role": "system", "content": "You are a careful assistant. " * 6},)
CONTEXTS = ("ctx-prompt", "ctx-chat")
"""A completion's context (a prompt) and a chat's (messages), one of each per tenant."""

SCALED_BLOCK, SCALED_EVERY, SCALED_SHARE = 300, 3, 0.2
"""Requests i with (i // SCALED_BLOCK) % SCALED_EVERY == 0 may go to the scaled model
(SCALED_SHARE of them): at the chaos run's 10-15 requests/s, 20-30 s of use, then
40-60 s idle, past conf/chaos.toml's idle_s."""

CHAT, COMPLETION, HOSTILE, POISON = "chat", "completion", "hostile", "poison"
PATHS = {CHAT: "/v1/chat/completions", COMPLETION: "/v1/completions"}

HOSTILE_CASES = ("malformed-json", "bad-temperature", "bad-max-tokens", "bad-n",
                 "unknown-model", "empty-messages", "wrong-type", "bad-key", "foreign-context")
"""Each must be answered 4xx with {"error": {"type", "message"}}; the last two need
api keys (two tenants, for foreign-context) and contexts."""


@dataclass(frozen=True)
class RequestSpec:
    id: int
    kind: str
    stream: bool = True
    n: int = 1
    prompt: int = 0
    """Index into Workload.prompts (completion) or CHATS (chat)."""
    context: str | None = None
    tenant: int = 0
    hostile: str | None = None
    model: int = 0
    """0: the node's model; 1: the scaled model."""

    @property
    def key(self) -> tuple:
        """What the greedy answer depends on: the oracle's key."""
        return (self.kind, self.prompt, self.context, self.model)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Workload:
    """tenants: api keys (None: no auth), one per tenant, the first the oracle's.
    contexts: (tenant index, context name) -> context id, filled at setup;
    empty: no context requests. scaled_model: a model that scales to zero, or None."""

    def __init__(self, seed: int, model: str, prompts: list[str], tenants: list[str | None],
                 max_tokens: int = 16, hostile_share: float = 0.05,
                 scaled_model: str | None = None):
        if not prompts or not tenants:
            raise ValueError("a workload needs prompts and at least one tenant")
        self.seed, self.model, self.prompts = seed, model, list(prompts)
        self.models = [model] + ([scaled_model] if scaled_model else [])
        self.tenants, self.max_tokens = list(tenants), max_tokens
        self.hostile_share = hostile_share
        self.contexts: dict[tuple[int, str], str] = {}

    @property
    def hostile_cases(self) -> list[str]:
        cases = [c for c in HOSTILE_CASES if c not in ("bad-key", "foreign-context")]
        if self.tenants[0] is not None:
            cases.append("bad-key")
        if len(self.tenants) > 1 and self.contexts:
            cases.append("foreign-context")
        return cases

    def spec(self, i: int) -> RequestSpec:
        """Request i of the run: the same for the same seed and i."""
        rng = random.Random(f"{self.seed}:{i}")
        tenant = rng.randrange(len(self.tenants))
        if rng.random() < self.hostile_share:
            return RequestSpec(i, HOSTILE, stream=False, tenant=tenant,
                               hostile=rng.choice(self.hostile_cases))
        kind = CHAT if rng.random() < 0.42 else COMPLETION
        stream = rng.random() < 0.6
        n = 2 if rng.random() < 0.15 else 1
        prompt = rng.randrange(len(CHATS) if kind == CHAT else len(self.prompts))
        context = None
        if self.contexts and rng.random() < 0.2:
            context = CONTEXTS[1] if kind == CHAT else CONTEXTS[0]
        model = 0  # drawn last: without a scaled model, the same requests as before it
        if len(self.models) > 1 and context is None \
                and (i // SCALED_BLOCK) % SCALED_EVERY == 0 and rng.random() < SCALED_SHARE:
            model = 1
        return RequestSpec(i, kind, stream, n, prompt, context, tenant, model=model)

    def oracle_specs(self, keys) -> list[RequestSpec]:
        """One plain request per key (streamed, n = 1, the first tenant)."""
        return [RequestSpec(-1 - j, kind, True, 1, prompt, context, 0, model=model)
                for j, (kind, prompt, context, model) in enumerate(sorted(keys, key=repr))]

    def all_keys(self) -> set[tuple]:
        """Every key a run may send (the oracle asks them all up front)."""
        plain = {(COMPLETION, p, None) for p in range(len(self.prompts))}
        plain |= {(CHAT, p, None) for p in range(len(CHATS))}
        keys = {(*k, m) for k in plain for m in range(len(self.models))}
        if self.contexts:  # contexts belong to the node's model
            keys |= {(COMPLETION, p, CONTEXTS[0], 0) for p in range(len(self.prompts))}
            keys |= {(CHAT, p, CONTEXTS[1], 0) for p in range(len(CHATS))}
        return keys

    # -- bodies ---------------------------------------------------------------------------
    def request(self, spec: RequestSpec) -> tuple[str, dict | bytes, dict]:
        """(path, body or raw bytes, headers) of `spec`."""
        headers = self.auth(spec.tenant)
        if spec.kind == HOSTILE:
            return self._hostile(spec, headers)
        body: dict = {"model": self.models[spec.model], "max_tokens": self.max_tokens,
                      "temperature": 0.0,
                      "stream": spec.stream}
        if spec.kind == CHAT:
            body.update(messages=list(CHATS[spec.prompt]), logprobs=True,
                        return_tokens_as_token_ids=True)
        else:
            body.update(prompt=self.prompts[spec.prompt], logprobs=1,
                        return_tokens_as_token_ids=True)
        if spec.stream:
            body["stream_options"] = {"include_usage": True}
        if spec.n > 1:
            body["n"] = spec.n
        if spec.context is not None:
            body["context_id"] = self.contexts[(spec.tenant, spec.context)]
        return PATHS[spec.kind], body, headers

    def auth(self, tenant: int) -> dict:
        key = self.tenants[tenant]
        return {"Authorization": f"Bearer {key}"} if key else {}

    def context_body(self, name: str, ttl_s: float) -> dict:
        body = {"model": self.model, "ttl_s": ttl_s}
        if name == CONTEXTS[0]:
            body["prompt"] = CONTEXT_PROMPT
        else:
            body["messages"] = list(CONTEXT_MESSAGES)
        return body

    def _hostile(self, spec: RequestSpec, headers: dict) -> tuple[str, dict | bytes, dict]:
        base = {"model": self.model, "prompt": "hello", "max_tokens": 4}
        case = spec.hostile
        if case == "malformed-json":
            return PATHS[COMPLETION], b'{"model": "' + self.model.encode() + b'", "prompt": ', \
                headers
        if case == "bad-key":
            return PATHS[COMPLETION], base, {"Authorization": "Bearer sk-not-a-key"}
        if case == "empty-messages":
            return PATHS[CHAT], {"model": self.model, "messages": []}, headers
        if case == "foreign-context":  # another tenant's id does not exist for this one
            other = (spec.tenant + 1) % len(self.tenants)
            return PATHS[COMPLETION], {**base, "context_id": self.contexts[(other, CONTEXTS[0])]}, \
                headers
        changes = {"bad-temperature": {"temperature": 7.5}, "bad-max-tokens": {"max_tokens": -3},
                   "bad-n": {"n": 99}, "unknown-model": {"model": "no-such-model"},
                   "wrong-type": {"prompt": 42}}[case]
        return PATHS[COMPLETION], {**base, **changes}, headers
