"""Fetch or recompute: the RTC's cost model (pure; numbers measured, not assumed).

For a prompt whose leading blocks are cached below the device (host, disk),
fetching the first k of those blocks costs

    fetch(k) = sum over tiers t used: latency_t + bytes_t(k) / bandwidth_t

and saves recomputing k * block_size tokens, which costs

    recompute(k) = k * block_size / prefill_tokens_per_s

The plan is the k (0 .. number of hits) with the least fetch(k) - recompute(k):
since both grow linearly in k, that is all of the hits or none of them once
each tier's latency is paid, so a short prefix on disk (one latency, few
tokens saved) is recomputed and a long one fetched.

The numbers start from a start-up profile (or the defaults here) and are
refreshed from what the TE observes: every finished fetch (bytes, seconds,
per tier) and every prefill step (tokens, forward seconds), as exponentially
weighted moving averages. The latency of a tier is what a fetch costs beyond
its bytes: the round trip to the workers and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HOST, DISK = "host", "disk"
TIERS = (HOST, DISK)


@dataclass
class TierSpeed:
    bandwidth: float  # bytes / s
    latency: float  # s per fetch (one op, however many blocks)

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass
class Plan:
    num_blocks: int  # leading hits to fetch
    fetch_s: float
    recompute_s: float

    @property
    def saves_s(self) -> float:
        return self.recompute_s - self.fetch_s


@dataclass
class CostModel:
    """block_bytes: one device block of this TE (all layers, its KV heads)."""

    block_bytes: int
    block_size: int
    prefill_tokens_per_s: float = 2000.0
    speeds: dict[str, TierSpeed] = field(default_factory=lambda: {
        HOST: TierSpeed(4e9, 2e-3), DISK: TierSpeed(1e9, 4e-3)})
    alpha: float = 0.2  # weight of a new observation
    enabled: bool = True  # False: always fetch every hit

    def plan(self, tiers: list[str]) -> Plan:
        """tiers: the tier of each leading hit below the device, in order."""
        best = Plan(0, 0.0, 0.0)
        used: dict[str, int] = {}
        for k, tier in enumerate(tiers, start=1):
            used[tier] = used.get(tier, 0) + 1
            fetch = sum(self.speeds[t].seconds(n * self.block_bytes) for t, n in used.items())
            recompute = k * self.block_size / self.prefill_tokens_per_s
            if recompute - fetch > best.saves_s or (not self.enabled and k > best.num_blocks):
                best = Plan(k, fetch, recompute)
        return best

    # -- observations ------------------------------------------------------------------
    def observe_fetch(self, tier: str, nbytes: int, seconds: float) -> None:
        """A fetch of nbytes from `tier` took `seconds` from dispatch to done."""
        if seconds <= 0 or nbytes <= 0:
            return
        s = self.speeds[tier]
        transfer = max(seconds - s.latency, seconds * 0.1)
        s.bandwidth = self._mix(s.bandwidth, nbytes / transfer)
        s.latency = self._mix(s.latency, max(0.0, seconds - nbytes / s.bandwidth))

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that computed num_tokens prompt tokens took `seconds` of forward."""
        if num_tokens >= self.block_size and seconds > 0:
            self.prefill_tokens_per_s = self._mix(self.prefill_tokens_per_s,
                                                  num_tokens / seconds)

    def _mix(self, old: float, new: float) -> float:
        return (1 - self.alpha) * old + self.alpha * new

    def snapshot(self) -> dict:
        return {"prefill_tokens_per_s": round(self.prefill_tokens_per_s, 1),
                **{f"{t}_bandwidth": round(s.bandwidth) for t, s in self.speeds.items()},
                **{f"{t}_latency_ms": round(s.latency * 1e3, 3) for t, s in self.speeds.items()}}
