"""Router at cluster scale (issue 16): candidates indexed by (model, type),
fair round robin across interleaved types, one hashing per job, cheap
TE-list updates, decisions equal to the plain per-candidate rules on random
workloads, and the job executor routing each model among its own TEs."""

import logging
import random
import shutil
import tempfile
from collections import Counter

import msgspec
import pytest
import zmq

from deepserve.cache.block_hash import prompt_block_hashes
from deepserve.control.je.routing import router as router_module
from deepserve.config.node import DualPathOptions, RouterSection
from deepserve.control.je import job_executor
from deepserve.control.je.job_executor import JobExecutor
from deepserve.control.je.routing.pd_policy import PDPolicy
from deepserve.control.je.routing.prompt_index import GlobalPromptIndex
from deepserve.control.je.routing.router import NoTEAvailable, PromptHashes, Router
from tests.control.je_rig import je_settings
from tests.control.test_router import BS, prompt, report, te


def mte(te_id: str, model: str, te_type: str = "colocated", block_size: int = BS):
    return msgspec.structs.replace(te(te_id, te_type, block_size), model=model)


def test_round_robin_is_fair_when_prefill_and_decode_decisions_alternate():
    """One shared counter picked only p0, p2, d1, d3 here (issue 16)."""
    r = Router("round_robin")
    r.update_tes([te(f"p{i}", "prefill") for i in range(4)]
                 + [te(f"d{i}", "decode") for i in range(4)])
    chosen = []
    for _ in range(8):  # 8 PD jobs: prefill then decode, as the JE decides them
        chosen += [r.route(prompt(16), te_type="prefill"), r.route(prompt(16), te_type="decode")]
    assert chosen[:8] == ["p0", "d0", "p1", "d1", "p2", "d2", "p3", "d3"]
    assert Counter(chosen) == {f"{k}{i}": 2 for k in "pd" for i in range(4)}


def test_model_restricts_the_candidates():
    r = Router("round_robin")
    r.update_tes([mte("a0", "a"), mte("b0", "b"), mte("a1", "a"), mte("ap", "a", "prefill")])
    assert [r.route(prompt(16), model="a") for _ in range(3)] == ["a0", "a1", "a0"]
    assert r.route(prompt(16), model="b") == "b0"
    assert r.route(prompt(16)) == "a1"  # None: any model's TEs
    assert r.route(prompt(16), model="a", exclude={"a0"}) == "a1"
    with pytest.raises(NoTEAvailable, match="no decode TE of model 'a'"):
        r.route(prompt(16), te_type="decode", model="a")
    assert r.te_types("a") == {"colocated", "prefill"} and r.te_types("b") == {"colocated"}
    assert r.te_types("a", exclude={"ap"}) == {"colocated"} and r.te_types("c") == set()
    assert r.te_types() == {"colocated", "prefill"}
    assert [t.te_id for t in r.candidates("colocated", "a", {"a1"})] == ["a0"]


def test_a_pd_job_hashes_its_prompt_once(monkeypatch):
    calls = []
    real = router_module.prompt_block_hashes
    monkeypatch.setattr(router_module, "prompt_block_hashes",
                        lambda *a: calls.append(a) or real(*a))
    r = Router()
    r.update_tes([te("p", "prefill"), te("d", "decode")])
    ids = prompt(64)
    hashes = PromptHashes(ids, "t")
    assert r.route(ids, "t", "prefill", hashes=hashes) == "p"
    assert r.route(ids, "t", "decode", hashes=hashes) == "d"
    assert len(calls) == 1 and hashes.get(BS) == prompt_block_hashes(ids, BS, "t")
    assert r.index.match("d", hashes.get(BS)) == 4  # both noted


def test_update_tes_skips_an_equal_list_and_touches_only_what_changed():
    r = Router("round_robin")
    listed = [te("a"), te("b"), te("c", "prefill")]
    r.update_tes(listed)
    r.on_report(report("b", load=7, inserted=prompt_block_hashes(prompt(32), BS)))
    tes = r.tes
    assert r.update_tes([msgspec.structs.replace(t) for t in listed]) == [] and r.tes is tes
    moved = msgspec.structs.replace(listed[1], incarnation="new")  # b restarted: same cache?
    bigger = msgspec.structs.replace(listed[0], block_size=32)  # a's hashes no longer compare
    assert r.update_tes([bigger, moved]) == ["c"]
    assert r.loads == {"a": 0, "b": 7} and r.tes["b"].incarnation == "new"
    assert r.index.num_hashes("b") == 2 and r.index.num_hashes("a") == 0
    assert [t.te_id for t in r.candidates("colocated")] == ["a", "b"] and r.te_types() == {
        "colocated"}
    r.update_tes([msgspec.structs.replace(moved, te_type="decode"), bigger])
    assert r.te_types() == {"colocated", "decode"} and r.route(prompt(16)) == "a"


# -- random workloads against the plain rules ---------------------------------------
class Plain:
    """The routing rules of router.py's module doc, computed per candidate."""

    def __init__(self, r: Router):
        self.r, self.order, self.last, self.num_listed = r, {}, {}, 0

    def listed(self, tes) -> None:
        """Never chosen: in the order first listed (a TE that left starts again)."""
        ids = {t.te_id for t in tes}
        self.last = {k: v for k, v in self.last.items() if k in ids}
        self.order = {k: v for k, v in self.order.items() if k in ids}
        for t in tes:
            if t.te_id not in self.order:
                self.order[t.te_id], self.num_listed = self.num_listed, self.num_listed + 1

    def choose(self, ids, te_type, model, exclude, salt) -> tuple[str, str]:
        r = self.r
        cands = [t for t in r.tes.values() if t.te_type == te_type and t.te_id not in exclude
                 and (model is None or t.model == model)]
        recent = {t.te_id: (self.last.get(t.te_id, -1), self.order[t.te_id]) for t in cands}
        loads = {t.te_id: r.loads[t.te_id] for t in cands}
        if r.policy == "round_robin":
            return min(recent, key=recent.get), "round_robin"
        balanced = r.is_balanced(list(loads.values()))
        if r.policy == "load" or (r.policy == "combined" and not balanced):
            pool = loads
            rule = "load"
        else:
            matched = {t.te_id: r.index.match(t.te_id, prompt_block_hashes(ids, t.block_size, salt))
                       for t in cands}
            pool = {i: loads[i] for i in matched if matched[i] == max(matched.values())}
            rule = "locality"
        least = min(pool.values())
        return min((i for i in pool if pool[i] == least), key=recent.get), rule

    def chosen(self, te_id: str, n: int) -> None:
        self.last[te_id] = n


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("policy", ["combined", "locality", "load", "round_robin"])
def test_decisions_equal_the_plain_rules(seed, policy):
    rng = random.Random(seed)
    now = [0.0]
    r = Router(policy, balance_threshold=rng.choice([0, 64, 2048]),
               index=GlobalPromptIndex(max_hashes_per_te=rng.choice([8, 1 << 18]),
                                       optimistic_ttl_s=5, clock=lambda: now[0]))
    plain = Plain(r)
    pool = [mte(f"{m}{k[0]}{i}", m, k, rng.choice([BS, BS, 32]))
            for m in "xy" for k in ("colocated", "prefill") for i in range(3)]
    prompts = [prompt(rng.randrange(8, 120), start=rng.choice([0, 0, 500])) for _ in range(6)]
    for n in range(250):
        if n % 40 == 0:
            listed = rng.sample(pool, rng.randrange(6, len(pool) + 1))
            r.update_tes(listed)
            plain.listed(listed)
        if rng.random() < 0.3 and r.tes:
            t = rng.choice(list(r.tes.values()))
            ids = rng.choice(prompts)
            r.on_report(report(t.te_id, load=rng.randrange(0, 300),
                               inserted=prompt_block_hashes(ids[:rng.randrange(len(ids))],
                                                            t.block_size),
                               evicted=prompt_block_hashes(ids, t.block_size)[-1:]))
        now[0] += rng.choice([0, 0, 1, 3])
        ids, salt = rng.choice(prompts), rng.choice([None, "s"])
        te_type, model = rng.choice(["colocated", "prefill"]), rng.choice(["x", "y", None])
        exclude = set(rng.sample(list(r.tes), rng.randrange(2))) if r.tes else set()
        try:
            want = plain.choose(ids, te_type, model, exclude, salt)
        except ValueError:  # no candidate
            with pytest.raises(NoTEAvailable):
                r.decide(ids, salt, te_type, exclude, model)
            continue
        got = r.decide(ids, salt, te_type, exclude, model)
        assert (got.te_id, got.rule) == want, n
        plain.chosen(got.te_id, n)
    r.index.check_integrity()


def test_the_job_executor_routes_a_model_among_its_own_tes(model_dirs):
    """_route / _job_layout take the model's TEs and types from the router's
    index: model a has PD pairs, model b only a colocated TE."""
    d, ctx = tempfile.mkdtemp(prefix="dsmm"), zmq.Context()
    first, other = list(model_dirs.values())[:2]
    je = JobExecutor(ctx, je_settings(f"ipc://{d}/je.sock", f"ipc://{d}/cm.sock",
                                      {"a": str(first), "b": str(other)}),
                     pd_policy=PDPolicy("disaggregated"))
    try:
        je.router.update_tes([mte("a-c", "a"), mte("b-c", "b"), mte("a-p", "a", "prefill"),
                              mte("a-d", "a", "decode"), mte("b-p", "b", "prefill")])
        ids = prompt(64)
        assert je._route(ids, None, "a") == ("a-d", "a-p", None)
        assert je._route(ids, None, "b") == ("b-c", None, None)  # b has no decode TE
        assert je._route(ids, None, "a", exclude=frozenset({"a-d"})) == ("a-c", None, None)
        assert je._route(ids, None, None) == ("a-d", "a-p", None)  # the default model: a
        assert je._job_layout(ids) == "disaggregated"  # any model's TEs (isolation's view)
    finally:
        je.close()
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("level", [logging.DEBUG, logging.INFO])
def test_dualpath_choices_reach_the_health_log_at_debug_level(model_dirs, caplog, level):
    """With [router] dualpath, each routed request's read path and the queues
    compared become a dualpath_decision health event, at DEBUG only."""
    d, ctx = tempfile.mkdtemp(prefix="dsdp"), zmq.Context()
    events = []
    je = JobExecutor(ctx, je_settings(f"ipc://{d}/je.sock", f"ipc://{d}/cm.sock",
                                      {"a": str(next(iter(model_dirs.values())))},
                                      router=RouterSection(dualpath=DualPathOptions())),
                     events=lambda event, **details: events.append((event, details)))
    caplog.set_level(level, logger=job_executor.__name__)
    try:
        je.router.update_tes([mte("p0", "a", "prefill"), mte("d0", "a", "decode")])
        assert je._route(prompt(64), None, "a", request_id="r1") == ("d0", "p0", "prefill")
        expected = [("dualpath_decision", {"request_id": "r1", "prefill_te": "p0",
                                           "decode_te": "d0", "read_path": "prefill",
                                           "pe_read_queue": 0, "de_read_queue": 0,
                                           "pe_reads": 0, "de_reads": 0})]
        assert events == (expected if level == logging.DEBUG else [])
    finally:
        je.close()
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)
