"""Isolation as a plain object (no sockets): what it sends where, given the
listed TEs, the suspects' tasks and a route that honours `exclude`."""

from deepserve.control.je.isolation import Isolation
from deepserve.control.je.suspects import HeldSuspects, SuspectBook
from deepserve.control.je.tasks import Task
from deepserve.control.je.routing.router import NoTEAvailable
from deepserve.messages.control import TEInfo
from deepserve.messages.engine import SubmitRequest
from deepserve.messages.sampling import SamplingParams


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _rig(te_ids, clock):
    listed = {t: TEInfo(te_id=t, model="m", address=f"ipc:///tmp/{t}") for t in te_ids}
    sent, failed, migrated = [], [], []

    def route(ids, salt, model, exclude=frozenset(), request_id=""):
        free = [t for t in listed if t not in exclude]
        if not free:
            raise NoTEAvailable("every TE excluded")
        return free[0], None, None
    suspects = SuspectBook(clock=clock)
    iso = Isolation(suspects, lambda: listed, lambda ids: "colocated", route,
                    lambda msg, ids, te, prefill, is_suspect, path:
                        sent.append((msg.request_id, te, is_suspect)) or True,
                    lambda msg, te, n: migrated.append((msg.request_id, te)),
                    lambda msg, error, text: failed.append((msg.request_id, error)),
                    HeldSuspects(hold_s=5.0, max_wait_s=60.0, clock=clock))
    return iso, suspects, sent, failed, migrated


def _resumed(request_id):
    return SubmitRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                         sampling=SamplingParams(max_tokens=2), attempt=1)


def test_a_suspect_goes_back_to_the_te_it_crashed_when_a_spare_stays_free():
    clock = Clock()
    iso, suspects, sent, failed, migrated = _rig(["te0", "te1", "te2"], clock)
    iso.note_listed(["colocated"] * 3)
    suspects.crashed("s", "te1")
    iso.hold(_resumed("s"), [1, 2, 3], [])
    assert sent == [("s", "te1", True)] and migrated == [("s", "te1")] and len(iso) == 0
    assert failed == []


def test_a_suspect_waits_beside_another_suspect_then_runs_solo_or_fails():
    clock = Clock()
    iso, suspects, sent, failed, migrated = _rig(["te0", "te1"], clock)
    suspects.crashed("s", "te0")
    busy = [Task("other", "te1", None, is_suspect=True)]  # te1 runs a suspect: no spare
    iso.hold(_resumed("s"), [1, 2, 3], busy)
    assert sent == [] and len(iso) == 1
    clock.t = 6.0  # past hold_s (no spare was ever listed): solo, never beside "other"
    iso.release(busy)
    assert sent == [("s", "te0", True)] and len(iso) == 0
    iso.hold(_resumed("t"), [1, 2, 3], [Task("a", "te0", None, is_suspect=True), *busy])
    clock.t = 70.0  # every TE runs a suspect until past max_wait_s
    iso.release([Task("a", "te0", None, is_suspect=True), *busy])
    assert failed == [("t", "engine_dead")] and len(iso) == 0


def test_an_aborted_suspect_is_dropped():
    iso, suspects, sent, _, _ = _rig(["te0"], Clock())
    iso.hold(_resumed("s"), [1], [Task("other", "te0", None, is_suspect=True)])
    iso.drop("s")
    iso.release([])
    assert len(iso) == 0 and sent == []
