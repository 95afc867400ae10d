"""Fetch or recompute: the plan at both ends, and learning from observations."""

from deepserve.tiers.cost_model import DISK, HOST, CostModel, TierSpeed


def model(**kw):
    return CostModel(block_bytes=32 * 1024, block_size=16, prefill_tokens_per_s=10_000,
                     speeds={HOST: TierSpeed(5e9, 1e-3), DISK: TierSpeed(1e9, 5e-3)}, **kw)


def test_short_prefix_on_disk_is_recomputed_long_one_fetched():
    m = model()
    # 2 blocks: recompute 32 tokens = 3.2 ms < disk 5 ms + 65 KB / 1 GB/s
    assert m.plan([DISK, DISK]).num_blocks == 0
    # 20 blocks: recompute 32 ms > 5 ms + 0.65 ms
    plan = m.plan([DISK] * 20)
    assert plan.num_blocks == 20 and plan.saves_s > 0.02


def test_host_latency_is_paid_once_then_all_hits_are_fetched():
    m = model()
    assert m.plan([HOST]).num_blocks == 1  # 1.6 ms saved > 1 ms + 6.5 us
    assert m.plan([HOST] * 3 + [DISK]).num_blocks == 3  # the disk op costs more than 1 block


def test_disabled_model_fetches_everything():
    m = model(enabled=False)
    assert m.plan([DISK]).num_blocks == 1
    assert m.plan([]).num_blocks == 0


def test_observations_move_the_numbers():
    m = model()
    for _ in range(50):
        m.observe_prefill(1600, 1.0)  # a much slower machine: 1600 tok/s
    assert 1600 <= m.prefill_tokens_per_s < 1700
    assert m.plan([DISK, DISK]).num_blocks == 2  # now recomputing 32 tokens costs 20 ms
    for _ in range(50):
        m.observe_fetch(DISK, 10 * 32 * 1024, 0.5)  # a very slow disk
    assert m.speeds[DISK].seconds(10 * 32 * 1024) > 0.3
    assert m.plan([DISK] * 10).num_blocks == 0


def test_tiny_observations_are_ignored():
    m = model()
    before = m.snapshot()
    m.observe_prefill(3, 0.001)  # under a block: not a prefill measurement
    m.observe_fetch(HOST, 0, 0.1)
    assert m.snapshot() == before
