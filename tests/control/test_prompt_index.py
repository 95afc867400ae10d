"""GlobalPromptIndex's reverse index (hash -> holders) and best_matches: exact
against the per-TE match on random workloads with evictions, the bound,
optimistic expiry and TEs that leave and come back."""

import random

import pytest

from deepserve.control.je.routing.prompt_index import GlobalPromptIndex


def chains(rng: random.Random, num: int = 8, length: int = 12) -> list[list[int]]:
    """Hash chains that share prefixes, as prompts of one system prefix do."""
    out = [[rng.getrandbits(62) for _ in range(length)]]
    while len(out) < num:
        base = rng.choice(out)
        cut = rng.randrange(length)
        out.append(base[:cut] + [rng.getrandbits(62) for _ in range(length - cut)])
    return out


def step(rng: random.Random, idx: GlobalPromptIndex, now: list, tes: list, paths: list) -> None:
    """One random mutation."""
    te_id, path = rng.choice(tes), rng.choice(paths)
    op = rng.random()
    if op < 0.35:
        held = [h for p in paths for h in p if idx.match(te_id, [h])]
        evicted = rng.sample(held, min(len(held), rng.randrange(4)))
        idx.apply(te_id, path[:rng.randrange(len(path) + 1)], evicted)
    elif op < 0.7:
        idx.note_routed(te_id, path[:rng.randrange(len(path) + 1)])
    elif op < 0.85:
        now[0] += rng.choice([0.0, 0.5, 2.0, 6.0])
    elif op < 0.93:
        idx.remove_te(te_id)
    else:
        idx.add_te(te_id)


@pytest.mark.parametrize("seed", range(12))
def test_best_matches_equal_the_per_te_match(seed):
    rng = random.Random(seed)
    now = [0.0]
    idx = GlobalPromptIndex(max_hashes_per_te=rng.choice([5, 20, 1 << 18]),
                            optimistic_ttl_s=5.0, clock=lambda: now[0])
    tes = [f"t{i}" for i in range(6)]
    for te_id in tes[:5]:  # t5 joins later, by add_te
        idx.add_te(te_id)
    paths = chains(rng)
    for _ in range(300):
        step(rng, idx, now, tes, paths)
        idx.check_integrity()
        candidates = rng.sample(tes + ["unknown"], rng.randrange(1, len(tes) + 2))
        query = rng.choice(paths)[:rng.randrange(13)]
        best, tied = idx.best_matches(candidates, query)
        per_te = {te_id: idx.match(te_id, query) for te_id in candidates}
        assert best == max(per_te.values())
        assert tied == {te_id for te_id, n in per_te.items() if n == best}


def test_expiry_visits_only_due_tes_and_drops_holders():
    now = [0.0]
    idx = GlobalPromptIndex(optimistic_ttl_s=10, clock=lambda: now[0])
    for te_id in ("a", "b"):
        idx.add_te(te_id)
    idx.note_routed("a", [1, 2, 3])
    now[0] = 4.0
    idx.note_routed("b", [1, 2])
    idx.apply("a", inserted=[1], evicted=[])  # promoted: never expires
    assert idx.best_matches(["a", "b"], [1, 2, 3]) == (3, {"a"})
    now[0] = 10.0  # a's optimistic 2, 3 expire; b's not yet
    assert idx.best_matches(["a", "b"], [1, 2, 3]) == (2, {"b"})
    assert idx.num_hashes("a") == 1 and idx.num_hashes("b") == 2
    now[0] = 14.0
    assert idx.best_matches(["a", "b"], [1, 2, 3]) == (1, {"a"})
    assert idx.num_hashes("b") == 0 and len(idx._expiry) == 0
    idx.check_integrity()
    idx.remove_te("a")
    assert idx.best_matches(["a", "b"], [1]) == (0, {"a", "b"})
    idx.check_integrity()
