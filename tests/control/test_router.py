"""Router and GlobalPromptIndex: DeepServe Algorithm 1, step 2 (pure Python)."""

import pytest

from deepserve.cache.block_hash import prompt_block_hashes
from deepserve.control.je.routing.prompt_index import GlobalPromptIndex
from deepserve.control.je.routing.router import NoTEAvailable, Router
from deepserve.messages.control import TEInfo, TEReport

BS = 16


def te(te_id: str, te_type: str = "colocated", block_size: int = BS) -> TEInfo:
    return TEInfo(te_id=te_id, te_type=te_type, model="m", address=f"ipc://{te_id}",
                  block_size=block_size)


def report(te_id: str, load: int = 0, inserted=(), evicted=(), finished=()) -> TEReport:
    return TEReport(te_id=te_id, num_waiting=0, num_running=0, load_tokens=load, kv_usage=0.0,
                    inserted=list(inserted), evicted=list(evicted), finished=list(finished))


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def router(policy: str, names=("a", "b", "c"), **kw) -> Router:
    r = Router(policy, **kw)
    r.update_tes([te(n) for n in names])
    return r


def test_round_robin_cycles_in_te_list_order_whatever_the_load_or_cache():
    r = router("round_robin")
    r.on_report(report("a", load=10_000, inserted=prompt_block_hashes(prompt(64), BS)))
    assert [r.route(prompt(64)) for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    assert r.last_decision.rule == "round_robin"


def test_load_picks_the_least_loaded_and_adds_the_prompt_optimistically():
    r = router("load")
    for name, load in (("a", 500), ("b", 100), ("c", 300)):
        r.on_report(report(name, load=load))
    assert r.route(prompt(250)) == "b"
    assert r.loads == {"a": 500, "b": 350, "c": 300}
    assert r.route(prompt(10)) == "c"
    assert r.loads == {"a": 500, "b": 350, "c": 310}
    r.on_report(report("b", load=0))  # the report replaces the optimistic sum
    assert r.loads["b"] == 0 and r.route(prompt(10)) == "b"
    assert r.last_decision.rule == "load"


def test_locality_picks_the_te_holding_the_longest_prefix():
    ids = prompt(80)  # 5 full blocks
    r = router("locality")
    r.on_report(report("a", load=0))
    r.on_report(report("b", load=900, inserted=prompt_block_hashes(ids[:64], BS)))  # 4 blocks
    r.on_report(report("c", load=0, inserted=prompt_block_hashes(ids[:32], BS)))  # 2 blocks
    assert r.route(ids) == "b"
    assert (r.last_decision.rule, r.last_decision.matched_blocks) == ("locality", 4)
    assert r.index.match("c", prompt_block_hashes(ids, BS)) == 2
    assert r.index.match("a", prompt_block_hashes(ids, BS)) == 0


def test_locality_ties_go_to_the_least_loaded_then_round_robin():
    r = router("locality")
    r.on_report(report("a", load=50))
    r.on_report(report("b", load=20))
    r.on_report(report("c", load=20))
    # nothing cached anywhere: tie at 0 blocks -> least loaded (b, c) -> round robin
    assert r.route(prompt(5, start=1)) == "b"  # 5 tokens: no full block, no note
    assert r.route(prompt(5, start=2)) == "c"


def test_different_salts_never_match():
    ids = prompt(64)
    r = router("locality", names=("a", "b"))
    r.on_report(report("a", load=0))
    r.on_report(report("b", load=100, inserted=prompt_block_hashes(ids, BS, "tenant-1")))
    assert r.route(ids, "tenant-1") == "b" and r.last_decision.matched_blocks == 4
    assert r.route(ids, "tenant-2") == "a" and r.last_decision.matched_blocks == 0
    assert r.index.match("b", prompt_block_hashes(ids, BS, None)) == 0


@pytest.mark.parametrize("load_b, expected, rule", [(100, "b", "locality"), (101, "a", "load")])
def test_combined_absolute_threshold_edge(load_b, expected, rule):
    ids = prompt(64)
    r = router("combined", names=("a", "b"), balance_threshold=100, balance_ratio=0.0)
    r.on_report(report("a", load=0))
    r.on_report(report("b", load=load_b, inserted=prompt_block_hashes(ids, BS)))
    assert r.route(ids) == expected
    assert r.last_decision.rule == rule
    assert r.is_balanced([0, load_b]) is (load_b == 100)


@pytest.mark.parametrize("load_b, expected, rule", [(500, "a", "locality"), (499, "b", "load")])
def test_combined_relative_threshold_edge(load_b, expected, rule):
    ids = prompt(64)
    r = router("combined", names=("a", "b"), balance_threshold=0, balance_ratio=0.5)
    r.on_report(report("a", load=1000, inserted=prompt_block_hashes(ids, BS)))
    r.on_report(report("b", load=load_b))
    assert r.balance_limit([1000, load_b]) == 500  # 0.5 * the largest load
    assert r.route(ids) == expected  # spread 500: balanced, 501: not
    assert r.last_decision.rule == rule


def test_evictions_remove_hashes_and_net_events_within_one_report():
    ids = prompt(64)
    hashes = prompt_block_hashes(ids, BS)
    idx = GlobalPromptIndex()
    idx.add_te("a")
    idx.apply("a", inserted=hashes, evicted=[])
    assert idx.match("a", hashes) == 4
    idx.apply("a", inserted=[], evicted=hashes[2:])  # leaves go first
    assert idx.match("a", hashes) == 2
    idx.apply("a", inserted=[hashes[1]], evicted=[hashes[1]])  # held: evicted, re-inserted
    assert idx.match("a", hashes) == 2
    idx.apply("a", inserted=[hashes[2]], evicted=[hashes[2]])  # absent: inserted, evicted
    assert idx.match("a", hashes) == 2
    idx.apply("a", inserted=[], evicted=hashes[:1])
    assert idx.match("a", hashes) == 0 and idx.num_hashes("a") == 1


def test_router_applies_report_evictions():
    ids = prompt(64)
    hashes = prompt_block_hashes(ids, BS)
    r = router("locality", names=("a", "b"))
    r.on_report(report("a", load=0))
    r.on_report(report("b", load=10, inserted=hashes))
    r.on_report(report("b", load=10, evicted=hashes))
    assert r.route(ids) == "a" and r.last_decision.matched_blocks == 0


def test_a_removed_te_is_never_chosen():
    ids = prompt(64)
    r = router("combined", names=("a", "b"))
    r.on_report(report("a", load=0, inserted=prompt_block_hashes(ids, BS)))
    r.on_report(report("b", load=5000))
    assert r.update_tes([te("b")]) == ["a"]
    assert not r.index.has_te("a") and "a" not in r.loads
    r.on_report(report("a", load=0, inserted=prompt_block_hashes(ids, BS)))  # late report
    for policy in ("round_robin", "load", "locality", "combined"):
        r.policy = policy
        assert {r.route(ids) for _ in range(4)} == {"b"}
    r.update_tes([te("a"), te("b")])  # back, but with an empty cache
    assert r.index.match("a", prompt_block_hashes(ids, BS)) == 0


def test_no_te_available():
    r = Router()
    with pytest.raises(NoTEAvailable):
        r.route(prompt(16))
    r.update_tes([te("p", "prefill")])
    with pytest.raises(NoTEAvailable, match="no colocated TE"):
        r.route(prompt(16))
    assert r.route(prompt(16), te_type="prefill") == "p"
    r.update_tes([])
    with pytest.raises(NoTEAvailable):
        r.route(prompt(16), te_type="prefill")


def test_te_type_filters_candidates():
    r = Router("round_robin")
    r.update_tes([te("c0"), te("p0", "prefill"), te("c1"), te("d0", "decode")])
    assert [r.route(prompt(16)) for _ in range(4)] == ["c0", "c1", "c0", "c1"]
    assert r.route(prompt(16), te_type="decode") == "d0"


@pytest.mark.parametrize("policy, same", [("combined", True), ("locality", True),
                                          ("round_robin", False)])
def test_back_to_back_equal_prompts_stick_before_any_report(policy, same):
    r = router(policy, names=("a", "b"))
    ids = prompt(300)
    first, second = r.route(ids), r.route(ids)
    assert (first == second) is same
    if same:
        assert r.last_decision.matched_blocks == 300 // BS


def test_combined_goes_to_load_once_the_sticky_te_is_overloaded():
    r = router("combined", names=("a", "b"), balance_threshold=1000, balance_ratio=0.0)
    ids = prompt(600)
    assert [r.route(ids) for _ in range(3)] == ["a", "a", "b"]  # 600 ok, 1200 > 1000
    assert r.last_decision.rule == "load"


def test_te_with_its_own_block_size_is_matched_with_it():
    ids = prompt(64)
    r = Router("locality")
    r.update_tes([te("a"), te("big", block_size=32)])
    r.on_report(report("a", load=0))
    r.on_report(report("big", load=10, inserted=prompt_block_hashes(ids, 32)))
    assert r.route(ids) == "big" and r.last_decision.matched_blocks == 2


def test_index_bound_drops_oldest_optimistic_first_then_oldest_confirmed():
    idx = GlobalPromptIndex(max_hashes_per_te=4)
    idx.add_te("a")
    idx.apply("a", inserted=[1, 2, 3], evicted=[])
    idx.note_routed("a", [4, 5, 6])  # 6 entries: drop optimistic 4, 5
    assert idx.num_hashes("a") == 4
    assert [idx.match("a", [h]) for h in (1, 2, 3, 4, 5, 6)] == [1, 1, 1, 0, 0, 1]
    idx.apply("a", inserted=[7, 8], evicted=[])  # drop optimistic 6, then confirmed 1
    assert [idx.match("a", [h]) for h in (1, 2, 3, 6, 7, 8)] == [0, 1, 1, 0, 1, 1]


def test_optimistic_entries_expire_and_are_promoted_when_reported():
    now = [0.0]
    idx = GlobalPromptIndex(optimistic_ttl_s=10, clock=lambda: now[0])
    idx.add_te("a")
    idx.note_routed("a", [1, 2])
    idx.apply("a", inserted=[1], evicted=[])  # 1 confirmed, 2 still optimistic
    now[0] = 9.9
    assert idx.match("a", [1, 2]) == 2
    now[0] = 10.0
    assert idx.match("a", [1, 2]) == 1 and idx.num_hashes("a") == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        Router("random")
    with pytest.raises(ValueError, match="balance_threshold"):
        Router(balance_threshold=-1)
    with pytest.raises(ValueError, match="max_hashes_per_te"):
        GlobalPromptIndex(max_hashes_per_te=0)
