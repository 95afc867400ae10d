"""The simulated half of tools/sim_cluster.py: TEs as queues and servers, and
the session workload. Nothing here routes or scales; that is the real code.

    SimTE (one engine; times from a Profile, never measured here)
      waiting ─┬─ colocated / prefill TE: prefill the head job, alone
               │    (prompt tokens - cached tokens) * prefill_s_per_token
               └─ decode TE: adopt the handed-off job (no compute)
      running ── decode steps, all of running at once (continuous batching):
               one step = decode_s_per_step + decode_s_per_seq * len(running)
      BlockLRU ── the chained block hashes it holds, at most cache_blocks;
               inserts / evictions since the last report go into its TEReport

A decode phase is one event, not one per step: it runs until the first
running job ends; a job that arrives meanwhile cuts it at the end of the step
in progress (prefill first, as when nothing is chunked).

    Workload: sessions pick a model and one of its few system prefixes, then
    take 1..N turns; turn k's prompt = the whole previous turn (prompt and
    output) + new user tokens, so a turn's leading blocks are the previous
    turn's. Token ids are random; only their block hashes matter.

Profile defaults are illustrative (GPU-like: 10k prefill tokens/s, 20 ms
decode steps), not measured on this machine; pass measured ones with
--profile FILE.json (keys: the Profile fields).
"""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields
from pathlib import Path

from deepserve.cache.block_hash import chain_hash, root_hash
from deepserve.messages.control import TEInfo, TEReport


@dataclass(frozen=True)
class Profile:
    """Service times of one simulated TE, seconds."""

    prefill_s_per_token: float = 1e-4  # uncached prompt token
    decode_s_per_step: float = 0.02  # one decode step, fixed part
    decode_s_per_seq: float = 2e-4  # one decode step, per running sequence
    kv_transfer_s_per_token: float = 1e-5  # prefill TE -> decode TE, per prompt token
    start_delay_s: float = 5.0  # ScaleOut -> TE listed
    max_batch: int = 32  # running sequences per TE
    cache_blocks: int = 1024  # KV blocks a TE's prefix cache holds
    block_size: int = 16

    @classmethod
    def load(cls, path: str | Path | None) -> "Profile":
        if path is None:
            return cls()
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown profile key(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


def extend_hashes(tokens: list[int], hashes: list[int], block_size: int) -> list[int]:
    """hashes of tokens' full blocks, given those of a prefix (the same values
    as cache/block_hash.prompt_block_hashes with no salt)."""
    out = list(hashes)
    h = out[-1] if out else root_hash(None)
    for start in range(len(out) * block_size, len(tokens) - block_size + 1, block_size):
        h = chain_hash(h, tokens[start:start + block_size])
        out.append(h)
    return out


@dataclass(eq=False)
class Job:
    """One request: a session's turn."""

    request_id: str
    model: str
    session: "Session"
    prompt: list[int]
    hashes: list[int]  # the prompt's full blocks
    full_hashes: list[int]  # prompt + output: what the TE holds when it ends
    num_output: int  # >= 2
    arrived: float
    te_id: str = ""  # colocated or decode TE
    prefill_te: str | None = None
    num_cached_blocks: int = 0  # on the TE that prefilled it
    remaining: int = 0  # decode steps left
    first_token_at: float | None = None
    finished_at: float | None = None


@dataclass(eq=False)
class Session:
    session_id: int
    model: str
    tokens: list[int]
    hashes: list[int]
    num_turns_left: int
    last_te: str | None = None  # the TE that prefilled the previous turn


class BlockLRU:
    """A TE's prefix cache as a bounded LRU of block hashes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.inserted: list[int] = []
        self.evicted: list[int] = []

    def num_leading(self, hashes: list[int]) -> int:
        """Leading blocks held (each one touched)."""
        for i, h in enumerate(hashes):
            if h not in self.blocks:
                return i
            self.blocks.move_to_end(h)
        return len(hashes)

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            if h in self.blocks:
                self.blocks.move_to_end(h)
                continue
            self.blocks[h] = None
            self.inserted.append(h)
            if len(self.blocks) > self.capacity:
                self.evicted.append(self.blocks.popitem(last=False)[0])

    def take_events(self) -> tuple[list[int], list[int]]:
        events = self.inserted, self.evicted
        self.inserted, self.evicted = [], []
        return events


class SimTE:
    """One simulated engine; `plan` is the action in progress:
    (kind, start, end, steps, job) with kind "prefill" or "decode"."""

    def __init__(self, info: TEInfo, profile: Profile):
        self.info, self.profile = info, profile
        self.cache = BlockLRU(profile.cache_blocks)
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.num_incoming = 0  # handed-off jobs on their way here
        self.plan: tuple | None = None
        self.version = 0  # bumped per plan: an event of an older plan is stale
        self.finished: list[str] = []
        self.num_prompt_tokens = self.num_cached_tokens = 0
        self.is_dirty = True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.num_incoming or self.plan)

    def add(self, job: Job, now: float) -> float | None:
        """Queue a job; the time of a new event to schedule, if any."""
        self.waiting.append(job)
        self.is_dirty = True
        return self.start(now) if self.plan is None else self._cut(now)

    def _cut(self, now: float) -> float | None:
        """End a long decode phase at the step in progress, so the new job goes next."""
        kind, start, end, steps, _ = self.plan
        if kind != "decode" or len(self.running) >= self.profile.max_batch:
            return None
        step_s = (end - start) / steps
        done = min(steps, max(1, math.ceil((now - start) / step_s - 1e-9)))
        if done >= steps:
            return None
        self.version += 1
        self.plan = ("decode", start, start + done * step_s, done, None)
        return self.plan[2]

    def start(self, now: float) -> float | None:
        """Plan the next action; its end time (None: idle)."""
        p = self.profile
        while self.waiting and self.info.te_type == "decode" and len(self.running) < p.max_batch:
            job = self.waiting.popleft()  # adopt: its KV came from the prefill TE
            self.cache.insert(job.hashes)
            job.remaining = job.num_output - 1
            self.running.append(job)
        if self.waiting and len(self.running) < p.max_batch:
            job = self.waiting.popleft()
            job.num_cached_blocks = self.cache.num_leading(job.hashes)
            num_new = max(1, len(job.prompt) - job.num_cached_blocks * p.block_size)
            self.num_prompt_tokens += len(job.prompt)
            self.num_cached_tokens += len(job.prompt) - num_new
            self.plan = ("prefill", now, now + num_new * p.prefill_s_per_token, 1, job)
        elif self.running:
            steps = min(j.remaining for j in self.running)
            step_s = p.decode_s_per_step + p.decode_s_per_seq * len(self.running)
            self.plan = ("decode", now, now + steps * step_s, steps, None)
        else:
            self.plan = None
            return None
        self.version += 1
        return self.plan[2]

    def complete(self, now: float) -> tuple[list[Job], Job | None]:
        """End the planned action: (jobs that ended, a job prefilled for a decode TE)."""
        kind, _, _, steps, job = self.plan
        self.plan, self.is_dirty = None, True
        if kind == "prefill":
            self.cache.insert(job.hashes)
            job.first_token_at = now
            if self.info.te_type == "prefill":
                return [], job
            job.remaining = job.num_output - 1
            self.running.append(job)
            return [], None
        for j in self.running:
            j.remaining -= steps
        ended = [j for j in self.running if j.remaining <= 0]
        self.running = [j for j in self.running if j.remaining > 0]
        for j in ended:
            self.cache.insert(j.full_hashes)
            j.finished_at = now
            self.finished.append(j.request_id)
        return ended, None

    def report(self) -> TEReport:
        inserted, evicted = self.cache.take_events()
        finished, self.finished = self.finished, []
        self.is_dirty = False
        prefilling = [self.plan[4]] if self.plan and self.plan[0] == "prefill" else []
        load = (sum(len(j.prompt) for j in [*self.waiting, *prefilling])
                + sum(j.remaining for j in self.running))
        return TEReport(te_id=self.info.te_id, num_waiting=len(self.waiting) + self.num_incoming,
                        num_running=len(self.running) + len(prefilling), load_tokens=load,
                        kv_usage=len(self.cache.blocks) / self.cache.capacity,
                        num_prompt_tokens=self.num_prompt_tokens,
                        num_cached_tokens=self.num_cached_tokens,
                        inserted=inserted, evicted=evicted, finished=finished)


@dataclass
class Workload:
    """Multi-turn sessions with shared system prefixes; ranges are inclusive."""

    rng: random.Random
    models: list[str]
    block_size: int = 16
    num_prefixes: int = 8  # system prompts per model
    prefix_tokens: tuple[int, int] = (32, 1024)
    user_tokens: tuple[int, int] = (16, 256)
    output_tokens: tuple[int, int] = (16, 256)
    turns: tuple[int, int] = (1, 8)
    think_s: float = 2.0  # mean pause between a turn's end and the next turn
    vocab: int = 32000
    prefixes: dict = field(default_factory=dict)
    num_sessions: int = 0

    def __post_init__(self):
        for m in self.models:
            tokens = [self._tokens(self.prefix_tokens) for _ in range(self.num_prefixes)]
            self.prefixes[m] = [(t, extend_hashes(t, [], self.block_size)) for t in tokens]

    def _tokens(self, bounds: tuple[int, int]) -> list[int]:
        return self.rng.choices(range(self.vocab), k=self.rng.randint(*bounds))

    def mean_turns(self) -> float:
        return sum(self.turns) / 2

    def new_session(self, max_turns: int) -> Session:
        model = self.rng.choice(self.models)
        tokens, hashes = self.rng.choice(self.prefixes[model])
        self.num_sessions += 1
        return Session(self.num_sessions, model, tokens, hashes,
                       min(max_turns, self.rng.randint(*self.turns)))

    def next_job(self, s: Session, now: float) -> Job:
        prompt = s.tokens + self._tokens(self.user_tokens)
        hashes = extend_hashes(prompt, s.hashes, self.block_size)
        output = self._tokens((max(2, self.output_tokens[0]), self.output_tokens[1]))
        full = prompt + output
        full_hashes = extend_hashes(full, hashes, self.block_size)
        s.tokens, s.hashes = full, full_hashes
        s.num_turns_left -= 1
        return Job(f"s{s.session_id}-t{s.num_turns_left}", s.model, s, prompt, hashes,
                   full_hashes, len(output), now)

    def think_time(self) -> float:
        return self.rng.expovariate(1.0 / self.think_s)
