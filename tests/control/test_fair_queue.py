"""The fair queue (control/je/fair_queue.py) and the tenants' book (fair_share.py):
pure objects, exact orders."""

from deepserve.config.tenants import TenantSection, TenantsSection
from deepserve.control.je.fair_queue import FairQueue
from deepserve.control.je.fair_share import RESERVE_S, FairShare, num_tokens
from deepserve.messages.control import TEInfo
from deepserve.messages.engine import SubmitRequest
from deepserve.messages.sampling import SamplingParams


def _order(queue: FairQueue, n: int | None = None) -> list:
    out = []
    while queue and (n is None or len(out) < n):
        out.append(queue.pop().item)
    return out


def test_weights_are_respected_in_order():
    q = FairQueue({"a": 2.0, "b": 1.0}.__getitem__)
    for i in range(6):
        q.push("a", f"a{i}", 10)
    for i in range(3):
        q.push("b", f"b{i}", 10)
    # finish tags: a 5,10,15,20,25,30; b 10,20,30 (ties: pushed first)
    assert _order(q) == ["a0", "a1", "b0", "a2", "a3", "b1", "a4", "a5", "b2"]


def test_cost_is_tokens_not_requests():
    q = FairQueue(lambda t: 1.0)
    q.push("long", "L0", 100)
    q.push("long", "L1", 100)
    for i in range(4):
        q.push("short", f"s{i}", 25)
    assert _order(q) == ["s0", "s1", "s2", "L0", "s3", "L1"]


def test_a_flood_does_not_starve_a_light_tenant():
    q = FairQueue(lambda t: 1.0)
    for i in range(1000):
        q.push("flood", f"f{i}", 10)
    assert _order(q, 5) == ["f0", "f1", "f2", "f3", "f4"]
    q.push("light", "x0", 10)  # arrives late, behind 995 of the flood's
    assert _order(q, 2) == ["x0", "f5"]  # next: it starts at the virtual time now
    for _ in range(50):
        q.pop()
    q.push("light", "x1", 10)  # idle meanwhile: it banked no credit, nor lost its place
    assert _order(q, 2) == ["x1", "f56"]
    assert q.num_queued("flood") == 1000 - 57 and len(q) == 943


def test_ties_are_deterministic_by_push_order():
    orders = set()
    for _ in range(3):
        q = FairQueue(lambda t: 1.0)
        for tenant in ("c", "a", "b"):
            q.push(tenant, tenant, 10)
        orders.add(tuple(_order(q)))
    assert orders == {("c", "a", "b")}


def test_remove_takes_out_only_the_matching_items():
    q = FairQueue(lambda t: 1.0)
    for i in range(3):
        q.push("a", i, 1)
    q.push("b", 10, 1)
    assert [t.item for t in q.remove(lambda item: item in (1, 10))] == [1, 10]
    assert _order(q) == [0, 2] and not q


def _msg(rid, tenant, max_tokens=4, attempt=0):
    return SubmitRequest(request_id=rid, prompt="x", tenant=tenant, attempt=attempt,
                         sampling=SamplingParams(max_tokens=max_tokens))


def test_max_requests_admits_exactly_the_limit_and_refuses_one_more():
    share = FairShare(TenantsSection(max_requests=2, retry_after_s=3))
    assert share.admit(_msg("r1", "a"), 10) is None
    assert share.admit(_msg("r2", "a"), 10) is None
    refused = share.admit(_msg("r3", "a"), 10)
    assert refused.error == "rate_limited" and refused.retry_after_s == 3
    assert "max_requests 2" in refused.message
    assert share.admit(_msg("r4", "b"), 10) is None  # another tenant has its own count
    assert share.admit(_msg("r2", "a", attempt=1), 10) is None  # resumed: never refused
    share.forget("r1")
    assert share.admit(_msg("r5", "a"), 10) is None and share.num_requests["a"] == 2


def test_max_tokens_admits_exactly_the_limit_and_refuses_one_more():
    share = FairShare(TenantsSection(max_tokens=100,
                                     named={"big": TenantSection(max_tokens=0, weight=3.0)}))
    assert share.admit(_msg("r1", "a"), 60) is None
    assert share.admit(_msg("r2", "a"), 40) is None  # exactly 100
    assert share.admit(_msg("r3", "a"), 1).error == "rate_limited"
    assert share.admit(_msg("r4", "big"), 10_000) is None  # its own: no limit
    assert share.weight("big") == 3.0 and share.weight("a") == 1.0
    share.forget("r2")
    assert share.num_tokens["a"] == 60


def test_slots_fill_and_the_queue_releases_in_fair_order():
    share = FairShare(TenantsSection(named={"b": TenantSection(weight=1.0)}))
    share.note_tes([TEInfo(te_id="te0", model="m", address="x", max_num_seqs=1),
                    TEInfo(te_id="te1", model="m", address="y")])  # 0: unbounded
    share.take("te0", "r0")
    assert share.full_tes() == {"te0"}
    for i in range(3):
        share.wait("m", _msg(f"a{i}", "a"), [1], 0.0)
    share.wait("m", _msg("b0", "b"), [1], 0.0)
    sent = []
    share.release(lambda m, ids, until, waited: len(sent) < 2 and not sent.append(m.request_id))
    assert sent == ["a0", "b0"] and share.waiting_by_tenant() == {"a": 2}
    assert share.drop("a2") and not share.drop("a2")
    share.note_tes([])  # the TE left: its slots go with it
    assert share.full_tes() == frozenset() and not share.used


def test_a_tenant_at_its_share_leaves_a_slot_for_each_tenant_heard_from_lately():
    now = [100.0]
    share = FairShare(TenantsSection(), clock=lambda: now[0])
    share.note_tes([TEInfo(te_id="te0", model="m", address="x", max_num_seqs=4)])
    for i in range(3):
        assert share.admit(_msg(f"a{i}", "a"), 10) is None
        share.take("te0", f"a{i}")
    assert share.full_tes("a") == frozenset()  # alone: a may take the last slot
    assert share.admit(_msg("b0", "b"), 10) is None  # b heard from: a (3 >= 4 / 2) keeps 1 free
    assert share.full_tes("a") == {"te0"} and share.full_tes("b") == frozenset()
    share.take("te0", "b0")
    assert share.full_tes("b") == {"te0"}  # no slot left at all
    share.give("b0")
    share.give("a2")  # a holds 2: exactly its share, the reserve still holds
    assert share.full_tes("a") == frozenset()  # 2 free > 1 reserved
    share.take("te0", "a2")
    assert share.full_tes("a") == {"te0"}
    now[0] += RESERVE_S + 0.1  # b silent past RESERVE_S: a takes the last slot
    assert share.full_tes("a") == frozenset()
    share.give("a0")
    share.give("a0")  # once only
    assert share.used["te0"] == 2 and share.slots_by_tenant == {"a": 2}


def test_an_unset_max_tokens_counts_the_rest_of_the_models_context():
    """The TE resolves it to at most max_len - prompt tokens: that is what it may ask."""
    ids = list(range(30))
    unset = SubmitRequest(request_id="u", prompt="x", sampling=SamplingParams())
    assert num_tokens(unset, ids, max_len=100) == 100
    assert num_tokens(unset, ids) == 31  # the context unknown: the prompt and one token
    assert num_tokens(_msg("s", "a", max_tokens=5), ids, max_len=100) == 35
    share = FairShare(TenantsSection(max_tokens=150))
    assert share.admit(unset, num_tokens(unset, ids, max_len=100)) is None
    share.wait("m", unset, ids, park_until=0.0)  # queued at what it was admitted with
    assert share.queues["m"].peek().item.msg is unset and share.num_tokens["default"] == 100
