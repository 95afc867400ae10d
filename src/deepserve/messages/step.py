"""Master -> workers: one step's batch; rank 0 -> master: the sampled tokens.

This is the seam between the scheduler and the ModelRunner. In-process the
engine hands a StepBatch straight to the runner; with worker processes the
same Struct is encoded once and broadcast to every worker.
"""

from __future__ import annotations

import msgspec

from deepserve.messages.cache import CacheOp
from deepserve.messages.pd import KVTransferOrder
from deepserve.messages.sampling import SamplingParams

SHUTDOWN_STEP_ID = -1  # a StepBatch with this id tells the workers to exit
CACHE_ONLY_STEP_ID = -2  # a StepBatch with this id only carries cache_ops: no forward, no StepDone
PLACEHOLDER = -1  # an input token the workers fill in: the one they sampled last for the seq


class ScheduledSeq(msgspec.Struct, array_like=True, gc=False):
    """One sequence's slice of the step.

    start: position of the first new token (= tokens already computed).
    token_ids: the new tokens, at positions start .. start + len - 1; with
        asynchronous scheduling the last may be PLACEHOLDER.
    block_table: KV block ids covering positions 0 .. start + len - 1.
    do_sample: the chunk ends the known tokens, so sample the next one.
    """

    seq_id: int
    start: int
    token_ids: list[int]
    block_table: list[int]
    do_sample: bool


class NewSeq(msgspec.Struct, array_like=True, gc=False):
    """A sequence the workers have not seen: its sampling state starts here.

    token_ids: its tokens so far (the prompt; for a decode task, the prompt
        and the prefill TE's first token) when its sampler reads them
        (repetition_penalty), else empty. The step's own token_ids cannot
        stand in: a prefix-cache hit is never sent to the workers.
    replay_ids: with a grammar (sampling.structured), the prompt's last
        num_replayed tokens: a resumed attempt's earlier output, which the
        grammar accepts, then output_ids, before the first sampled token.
    output_ids: its output so far (a PD decode task's first token; empty for
        a new request), which presence/frequency_penalty, min_tokens and
        bad_words_ids read. A resumed attempt's earlier output is in its
        prompt, not here (worker/penalties.py).
    stop_token_ids: when min_tokens > 0, what it masks until then: the
        sequence's stop ids (EOS unless ignore_eos, and the request's own),
        as the master assembled them (engine/step_core.py).
    """

    seq_id: int
    sampling: SamplingParams
    token_ids: list[int] = []
    replay_ids: list[int] = []
    output_ids: list[int] = []
    stop_token_ids: list[int] = []


class StepBatch(msgspec.Struct, array_like=True, gc=False):
    step_id: int
    seqs: list[ScheduledSeq]
    new_seqs: list[NewSeq] = []
    finished_seq_ids: list[int] = []  # drop their sampling state
    transfers: list[KVTransferOrder] = []  # KV to send to decode TEs (messages/pd.py)
    cache_ops: list[CacheOp] = []  # host / disk tier copies (messages/cache.py), off the forward


class SampledToken(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """logprob: of token_id under the model's distribution; top: the N most
    likely (token_id, logprob) pairs, when the request asked for logprobs.
    prompt: on the first token of a request that asked for prompt_logprobs,
    (token_id, logprob, top) of each prompt token after the first, as the
    model predicted it from the tokens before (worker/prompt_logprobs.py)."""

    seq_id: int
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    prompt: list[tuple[int, float, list[tuple[int, float]]]] | None = None


class SeqFailed(msgspec.Struct, array_like=True, gc=False):
    """A sequence this step could not serve for a reason of its own (its
    sampling state, a bad value): the master fails that request alone."""

    seq_id: int
    message: str


class LoadLost(msgspec.Struct, array_like=True, gc=False):
    """A layered KV load (CacheOp load_layers) failed during this step's
    forward: its sequence computed on KV it does not have, so it was not
    sampled; the master frees it uncommitted and the request is retried.
    corrupt: hashes of block files that failed their checks."""

    seq_id: int
    message: str
    corrupt: list[int] = []


class StepOutput(msgspec.Struct, array_like=True, gc=False):
    step_id: int
    sampled: list[SampledToken]
    failed: list[SeqFailed] = []  # each reported once, in the step that found it
    lost_loads: list[LoadLost] = []
