"""Sequence: one request's tokens and progress inside a TE."""

from __future__ import annotations

import enum
from typing import Hashable

from deepserve.messages.sampling import SamplingParams
from deepserve.messages.step import PLACEHOLDER  # noqa: F401  (re-exported)


class SequenceStatus(enum.Enum):
    """WAITING -> RUNNING -> FINISHED; RUNNING -> WAITING when preempted
    (its KV is dropped and recomputed on re-admission)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, prompt_token_ids: list[int], sampling: SamplingParams,
                 stop_token_ids: frozenset[int], salt: Hashable = None):
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)  # prompt, then output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.stop_token_ids = stop_token_ids  # EOS (unless ignore_eos) + the request's own
        self.salt = salt
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the pool (or being written)
        self.num_pending_tokens = 0  # trailing PLACEHOLDERs: sampled by steps in flight
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.num_preemptions = 0
        self.is_known_to_workers = False
        self.keep_kv = False  # a prefill task's KV outlives it until the decode TE has it
        self.holder_seq_id: int | None = None  # blocks a lower tier filled for it (tiers.py)
        self.preloaded_tokens: int | None = None  # it holds its blocks, these filled
        # (or being filled, layer by layer) by a lower tier: engine/tiers/layered.py
        self.tier_tokens: dict[str, int] = {}  # prompt tokens fetched per lower tier
        self.kv_stream = None  # DualPath: a KVStream (messages/pd.py) of hits read for it
        self.kv_from_peer = False  # a decode task: its prompt's KV came from a prefill TE
        self.pin_context = None  # a ContextPin: its blocks are pinned before it ends
        self.tenant: str | None = None  # who pays (the scheduler's light-tenant steps)
        self.tenant_weight = 1.0  # its [tenants] weight: its share of a step with others
        self.finish_reason: str | None = None
        self.logprobs: list = []
        self.prompt_logprobs: list | None = None  # SampledToken.prompt, when asked for

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
