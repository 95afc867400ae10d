"""ModelRunner: one step's StepBatch in, one StepOutput out.

It owns the model, this device's KV pool and the per-sequence sampling state
(parameters, random generator, and the token state its logits processors
read: sampler.SequenceTokens), so the master never ships tensors: it sends
token ids, positions and block ids, and gets token ids back. A step's logits
are processed (biases, masks, penalties), then sampled (_sample_rows).

KV pool layout: one tensor (2, L, Hkv, num_blocks, block_size, D); the first
index is K or V; see model/attention.py for why it is head-major. With tensor
parallelism Hkv is this rank's share (Hkv / tp): each rank keeps the K/V of
its own heads only, under the same block ids as every other rank.

A request's own failure stays its own (issue 11): setting up its sampling
state or sampling its row may raise for a reason of that request alone (a
value the sampler cannot take, a shape error in its state). Such an error
(see is_request_error) marks the sequence failed: StepOutput.failed reports
it once, its rows are never sampled again, and a PLACEHOLDER of a step
already in flight reads token 0, so the batch's other sequences carry on.
Everything else — the forward, which writes every sequence's KV, and any
device, memory or collective error — is fatal to the worker.
"""

from __future__ import annotations

import time

import torch

from deepserve.ipc.timeline import Timeline
from deepserve.messages.sampling import SamplingParams
from deepserve.messages.step import (PLACEHOLDER, SampledToken, ScheduledSeq, SeqFailed,
                                     StepBatch, StepOutput)
from deepserve.model import kernels
from deepserve.model.attention import AttentionMetadata, PrefillSpan
from deepserve.model.decoder import CausalLM
from deepserve.model.parallel import TensorParallel
from deepserve.structured.matchers import GrammarError
from deepserve.worker.prompt_logprobs import PromptLogprobs
from deepserve.worker.sampler import LOGPROB_FLOOR, SequenceTokens, logprobs_of, sample

_FATAL_WORDS = ("cuda", "cublas", "cudnn", "nccl", "hip", "device-side", "out of memory",
                "illegal memory", "gloo", "collective")


def is_request_error(exc: BaseException) -> bool:
    """An error of one request's own sampling work that leaves the worker
    sound: a plain Python or shape error. Fatal (False): memory (host or
    device), anything naming the device, its libraries or a collective
    (after one of those the device or the process group is suspect), and
    anything that is not an Exception."""
    if not isinstance(exc, Exception) or isinstance(exc, MemoryError):
        return False
    if isinstance(exc, getattr(torch, "OutOfMemoryError", MemoryError)):
        return False
    if type(exc).__name__ in ("AcceleratorError", "CudaError", "DistBackendError", "DistError"):
        return False
    text = f"{type(exc).__name__} {exc}".lower()
    return not any(word in text for word in _FATAL_WORDS)


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, seed: int = 0,
                 kv_pool: torch.Tensor | None = None):
        """kv_pool: optional caller-allocated storage (e.g. shared memory) of
        kv_pool_shape(...) and the model dtype; by default one is allocated here."""
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = self.kv_pool_shape(model, num_blocks, block_size)
        if kv_pool is None:
            kv_pool = torch.empty(shape, dtype=cfg.dtype)
        elif tuple(kv_pool.shape) != shape or kv_pool.dtype != cfg.dtype:
            raise ValueError(f"kv_pool is {tuple(kv_pool.shape)} {kv_pool.dtype}, "
                             f"this rank needs {shape} {cfg.dtype}")
        # Zeroed, not empty: padded decode slots are masked, but NaN * 0 is NaN.
        self.kv_pool = kv_pool.zero_()  # (2, L, Hkv_local, NB, bs, D)
        self.kv_caches = [(self.kv_pool[0, i], self.kv_pool[1, i]) for i in range(cfg.num_layers)]
        self._sampling: dict[int, tuple[SamplingParams, torch.Generator]] = {}
        # What the logits processors read of each sequence's tokens (sampler.py).
        self.tokens = SequenceTokens(cfg.vocab_size)
        self.seen = self.tokens.seen  # tokens of sequences with a repetition penalty
        self.prompt_lps = PromptLogprobs(LOGPROB_FLOOR)  # of the sequences that ask
        self._default_generator = torch.Generator().manual_seed(seed)
        self._last_sampled: dict[int, int] = {}  # seq_id -> token sampled in its last step
        self._failed: dict[int, str] = {}  # seq_id -> why: never sampled again
        self._new_failures: list[SeqFailed] = []  # found in this step: reported with it

    @staticmethod
    def kv_pool_shape(model: CausalLM, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """(2, L, Hkv_local, NB, bs, D): this rank's pool; Hkv_local = Hkv / tp."""
        cfg = model.config
        return (2, cfg.num_layers, model.num_local_kv_heads, num_blocks, block_size,
                cfg.head_dim)

    def _layer_hook(self, after_layer):
        on_layer = self.on_layer
        if on_layer is None or after_layer is None:
            return after_layer or on_layer

        def both(i: int) -> None:
            after_layer(i)
            on_layer(i)
        return both

    on_layer = None  # the worker's per-layer hook (a heartbeat with progress), if any
    layer_loads = None  # the worker's layered KV loads (worker/layer_loads.py), if any
    grammars = None  # the sequences' grammars (structured/matchers.py GrammarBook), if any
    timeline = Timeline("runner")  # off; the worker sets its own

    def execute(self, batch: StepBatch, after_layer=None) -> StepOutput:
        """after_layer: see CausalLM.forward (layer-wise KV transfer)."""
        t0 = time.monotonic()
        self._update_states(batch)
        self._resolve_placeholders(batch)
        input_ids, positions, meta = self._prepare(batch.seqs)
        loads = self.layer_loads.forward(batch.seqs) if self.layer_loads is not None else None
        t1 = time.monotonic()
        try:
            with kernels.denormals_flushed():
                hidden = self.model(input_ids, positions, meta, self.kv_caches,
                                    self._layer_hook(after_layer),
                                    loads.before_layer if loads else None)  # (T, E)
        finally:
            lost = loads.end() if loads else []
        for x in lost:  # computed without its KV: never sampled, the master retries it
            self._failed[x.seq_id] = x.message
        t2 = time.monotonic()
        sampled: list[SampledToken] = []
        prompt = self.prompt_lps.step(batch.seqs, hidden, self.model.compute_logits) \
            if self.prompt_lps else {}
        rows = self._last_rows(batch.seqs)  # (seq, its last row) of every sampling seq
        live = [(s, row) for s, row in rows if s.seq_id not in self._failed]
        if live:
            last_rows = torch.tensor([row for _, row in live], dtype=torch.long)
            logits = self.model.compute_logits(hidden[last_rows])  # (N, V)
            sampled = self._sample([s for s, _ in live], logits)
        for token in sampled:
            self._last_sampled[token.seq_id] = token.token_id
            token.prompt = prompt.get(token.seq_id)
        for s, _ in rows:  # a failed seq's placeholder in a step in flight reads 0
            if s.seq_id in self._failed:
                self._last_sampled[s.seq_id] = 0
        failed, self._new_failures = self._new_failures, []
        if self.timeline.on:
            t3 = time.monotonic()
            self.timeline.add("prepare", batch.step_id, t0, t1)
            self.timeline.add("forward", batch.step_id, t1, t2, int(input_ids.numel()))
            self.timeline.add("sample", batch.step_id, t2, t3, len(sampled))
        return StepOutput(batch.step_id, sampled, failed, lost)

    def _fail(self, seq_id: int, exc: Exception) -> None:
        message = f"{type(exc).__name__}: {exc}"
        self._failed[seq_id] = message
        self._new_failures.append(SeqFailed(seq_id, message))

    def _resolve_placeholders(self, batch: StepBatch) -> None:
        """Asynchronous scheduling: a PLACEHOLDER input is the token this
        runner sampled for that sequence in its previous step."""
        for seq in batch.seqs:
            if PLACEHOLDER in seq.token_ids:
                last = self._last_sampled[seq.seq_id]
                seq.token_ids = [last if t == PLACEHOLDER else t for t in seq.token_ids]

    def _update_states(self, batch: StepBatch) -> None:
        for seq_id in batch.finished_seq_ids:
            if self.layer_loads is not None:
                self.layer_loads.drop(seq_id)
            self._sampling.pop(seq_id, None)
            self.prompt_lps.drop(seq_id)
            self.tokens.drop(seq_id)
            if self.grammars is not None:
                self.grammars.drop(seq_id)
            self._last_sampled.pop(seq_id, None)
            self._failed.pop(seq_id, None)
        for new in batch.new_seqs:
            try:
                # The master resolved every field; what a hand-made batch
                # leaves unset reads as the built-in default.
                sampling = new.sampling.with_defaults({})
                self._sampling[new.seq_id] = (sampling, self._generator(sampling))
                self.tokens.add(new.seq_id, sampling, new.token_ids, new.output_ids,
                                new.stop_token_ids)
                if sampling.prompt_logprobs is not None:
                    self.prompt_lps.add(new.seq_id, sampling.prompt_logprobs)
                if sampling.structured is not None:
                    if self.grammars is None:
                        raise ValueError("this worker serves no structured outputs")
                    self.grammars.add(new.seq_id, sampling.structured,
                                      new.replay_ids + new.output_ids)
            except Exception as exc:
                if not is_request_error(exc):
                    raise
                self._fail(new.seq_id, exc)

    def _generator(self, p: SamplingParams) -> torch.Generator:
        if p.seed is None:
            return self._default_generator
        # Modulo 2**64: the same generator for every seed torch takes, and
        # no crash on one it would refuse (validate() refuses those too).
        return torch.Generator().manual_seed(p.seed % 2**64)

    def _sample(self, seqs: list[ScheduledSeq], logits: torch.Tensor) -> list[SampledToken]:
        """The whole batch at once; if that raises a request error, row by row,
        so only the rows that raise fail. Seeded generators are rewound first:
        a seeded request draws the same numbers whoever failed beside it."""
        seeded = {id(g): (g, g.get_state()) for s in seqs
                  for p, g in [self._sampling.get(s.seq_id, (None, None))]
                  if p is not None and p.seed is not None and not p.is_greedy}
        try:
            return self._sample_rows(seqs, logits)
        except Exception as exc:
            if not is_request_error(exc):
                raise
        for gen, state in seeded.values():
            gen.set_state(state)
        out = []
        for i, seq in enumerate(seqs):
            try:
                out += self._sample_rows([seq], logits[i:i + 1])
            except Exception as exc:
                if not is_request_error(exc):
                    raise
                self._fail(seq.seq_id, exc)
        return out

    def _sample_rows(self, seqs: list[ScheduledSeq], logits: torch.Tensor
                     ) -> list[SampledToken]:
        params, gens = zip(*(self._sampling[s.seq_id] for s in seqs))
        params, gens, seq_ids = list(params), list(gens), [s.seq_id for s in seqs]
        processed = self.tokens.process(seq_ids, params, logits)  # biases, masks, penalties
        tokens = sample(self._masked(seq_ids, processed), params, gens)
        lps = logprobs_of(logits, tokens, [p.logprobs for p in params])  # the model's own
        self.tokens.mark(seq_ids, tokens)  # last: rows that raise are sampled again
        refused = self.grammars.accept(seq_ids, tokens.tolist()) if self.grammars else []
        for seq_id in refused:
            self._fail(seq_id, GrammarError("the grammar refused the sampled token"))
        out = []
        for seq, token, lp in zip(seqs, tokens.tolist(), lps):
            if seq.seq_id in self._failed:
                continue
            if lp is None:
                out.append(SampledToken(seq.seq_id, token))
            else:
                out.append(SampledToken(seq.seq_id, token, lp[0], lp[1]))
        return out

    def _masked(self, seq_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """logits with every grammar row's disallowed tokens at -inf (a copy:
        logprobs stay the model's own distribution, as vLLM reports them)."""
        if self.grammars is None or not any(s in self.grammars for s in seq_ids):
            return logits
        return self.grammars.mask(seq_ids, logits.float().clone())

    def _last_rows(self, seqs: list[ScheduledSeq]) -> list[tuple[ScheduledSeq, int]]:
        rows, row = [], 0
        for s in seqs:
            row += len(s.token_ids)
            if s.do_sample:
                rows.append((s, row - 1))
        return rows

    def _prepare(self, seqs: list[ScheduledSeq]):
        """Flat input ids and positions (T,), and the attention metadata."""
        input_ids: list[int] = []
        positions: list[int] = []
        for s in seqs:
            input_ids.extend(s.token_ids)
            positions.extend(range(s.start, s.start + len(s.token_ids)))
        pos = torch.tensor(positions, dtype=torch.long)
        tables = _padded_tables(seqs)  # (B, max_blocks)
        block_of_token = torch.repeat_interleave(
            tables, torch.tensor([len(s.token_ids) for s in seqs]), dim=0)
        slot_mapping = self._slots(block_of_token, pos)
        meta = self._attention_metadata(seqs, tables, slot_mapping)
        return torch.tensor(input_ids, dtype=torch.long), pos, meta

    def _slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tables: (N, max_blocks), positions: (N,) -> slots (N,)."""
        bs = self.block_size
        blocks = tables.gather(1, (positions // bs).unsqueeze(1)).squeeze(1)
        return blocks * bs + positions % bs

    def _attention_metadata(self, seqs: list[ScheduledSeq], tables: torch.Tensor,
                            slot_mapping: torch.Tensor) -> AttentionMetadata:
        decode_idx, decode_rows, prefills, row = [], [], [], 0
        for i, s in enumerate(seqs):
            n, ctx = len(s.token_ids), s.start + len(s.token_ids)
            if n == 1:
                decode_idx.append(i)
                decode_rows.append(row)
            else:
                blocks = tables[i, :len(s.block_table)]
                prefills.append(PrefillSpan(row, n, blocks, ctx))
            row += n
        ctx_lens = torch.tensor([seqs[i].start + 1 for i in decode_idx], dtype=torch.long)
        width = max((len(seqs[i].block_table) for i in decode_idx), default=0)
        decode_tables = tables[decode_idx, :width] if len(decode_idx) < len(seqs) \
            else tables[:, :width]
        return AttentionMetadata(slot_mapping, torch.tensor(decode_rows, dtype=torch.long),
                                 decode_tables.contiguous(), ctx_lens, self.block_size,
                                 prefills, is_all_decode=not prefills)


def _padded_tables(seqs: list[ScheduledSeq]) -> torch.Tensor:
    width = max(len(s.block_table) for s in seqs)
    return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                        dtype=torch.long)
