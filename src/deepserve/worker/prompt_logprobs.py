"""Prompt logprobs: each prompt token's logprob under the model, predicted
from the tokens before it (vLLM's prompt_logprobs; completions' echo with
logprobs, the log-likelihood evaluation harnesses read).

A prompt is computed in chunks (chunked prefill), so the last row of one
chunk predicts the first token of the next: that row's log-softmax is kept
until the next chunk arrives. Logits are computed for a sequence's rows
ROWS_PER_PASS at a time ((rows, vocab) float32 each pass), only for the
sequences that ask. The entries are held until the chunk that ends the
prompt, and travel with the request's first sampled token
(SampledToken.prompt); a sequence is done once it has sampled, so the
recompute after a preemption adds nothing. The first prompt token has no
logprob (nothing comes before it). Values are floored like every logprob
(sampler.LOGPROB_FLOOR).
"""

from __future__ import annotations

import torch

from deepserve.messages.step import ScheduledSeq

ROWS_PER_PASS = 128
Entry = tuple[int, float, list[tuple[int, float]]]


class PromptLogprobs:
    def __init__(self, floor: float):
        self.floor = floor
        self._entries: dict[int, list[Entry]] = {}  # seq_id -> entries so far
        self._carry: dict[int, torch.Tensor] = {}  # seq_id -> last row's log-softmax (V,)
        self._num_top: dict[int, int] = {}

    def add(self, seq_id: int, num_top: int) -> None:
        self._entries[seq_id], self._num_top[seq_id] = [], num_top

    def drop(self, seq_id: int) -> None:
        self._entries.pop(seq_id, None)
        self._carry.pop(seq_id, None)
        self._num_top.pop(seq_id, None)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def step(self, seqs: list[ScheduledSeq], hidden: torch.Tensor, compute_logits
             ) -> dict[int, list[Entry]]:
        """Note this step's prompt rows; return seq_id -> all its entries for
        each asking sequence whose prompt ends in this step (it samples)."""
        done, row = {}, 0
        for seq in seqs:
            n = len(seq.token_ids)
            if seq.seq_id in self._entries:
                self._chunk(seq, hidden[row:row + n], compute_logits)
                if seq.do_sample:
                    done[seq.seq_id] = self._entries.pop(seq.seq_id)
                    self._num_top.pop(seq.seq_id, None)
            row += n
        return done

    def _chunk(self, seq: ScheduledSeq, hidden: torch.Tensor, compute_logits) -> None:
        entries, num_top = self._entries[seq.seq_id], self._num_top[seq.seq_id]
        targets = seq.token_ids
        carry = self._carry.pop(seq.seq_id, None)
        if carry is not None:
            entries.append(self._entry(carry, targets[0], num_top))
        for lo in range(0, len(targets), ROWS_PER_PASS):
            logp = self._log_softmax(compute_logits(hidden[lo:lo + ROWS_PER_PASS]))
            for i in range(logp.shape[0]):
                nxt = lo + i + 1
                if nxt < len(targets):
                    entries.append(self._entry(logp[i], targets[nxt], num_top))
                elif not seq.do_sample:
                    self._carry[seq.seq_id] = logp[i].clone()

    def _log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits.float(), dim=-1)
        return torch.nan_to_num(logp, nan=self.floor).clamp_(min=self.floor)

    @staticmethod
    def _entry(logp: torch.Tensor, token: int, num_top: int) -> Entry:
        top = torch.topk(logp, min(num_top, logp.numel())) if num_top else None
        pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        return token, float(logp[token]), pairs
