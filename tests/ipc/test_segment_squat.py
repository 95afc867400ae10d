"""A name squat in /dev/shm, or a segment we may not unlink, never stops a TE
from starting again: the launcher fails over to a fresh run id, and unlinking
is cleanup (logged, never raised)."""

from __future__ import annotations

import logging

import pytest

from deepserve.ipc import segments
from deepserve.ipc.segments import (create_segment, free_run_id, list_segments, segment_name,
                                    unlink_segment)


def _deny_unlink(monkeypatch):
    def shm_unlink(path):
        raise PermissionError(1, "Operation not permitted", path)
    monkeypatch.setattr(segments._posixshmem, "shm_unlink", shm_unlink)


def test_free_run_id_keeps_a_free_id(run_id):
    assert free_run_id(run_id) == run_id


def test_free_run_id_fails_over_past_a_squat(run_id):
    squat = create_segment(segment_name(run_id, "steps"), 64)
    try:
        fresh = free_run_id(run_id)
        assert fresh != run_id and fresh.startswith(run_id)  # a prefix sweep still finds it
        assert list_segments(segment_name(fresh, "")) == []
        assert list_segments(f"deepserve-{run_id}") == [segment_name(run_id, "steps")]  # untouched
        create_segment(segment_name(fresh, "steps"), 64).close()  # the name is usable
        unlink_segment(segment_name(fresh, "steps"))
    finally:
        squat.close()
        unlink_segment(segment_name(run_id, "steps"))


def test_unlink_permission_error_is_logged_not_raised(run_id, monkeypatch, caplog):
    name = segment_name(run_id, "held")
    create_segment(name, 64).close()
    with monkeypatch.context() as patch:
        _deny_unlink(patch)
        with caplog.at_level(logging.WARNING, logger=segments.__name__):
            assert unlink_segment(name) is False
        assert any(name in r.getMessage() for r in caplog.records)
    assert list_segments(f"deepserve-{run_id}") == [name]
    assert unlink_segment(name) is True


def test_sweep_survives_an_unlink_permission_error(run_id, monkeypatch):
    from deepserve.supervisor.process_table import sweep_scratch
    name = segment_name(f"{run_id}te0-1", "steps")
    create_segment(name, 64).close()
    with monkeypatch.context() as patch:
        _deny_unlink(patch)
        assert sweep_scratch(f"{run_id}te0-") == [name]  # no exception
    unlink_segment(name)


@pytest.mark.slow
def test_te_starts_past_a_squat_and_an_unlink_it_may_not_do(run_id, monkeypatch, tiny_model):
    """The names the next incarnation would use are taken (by us, but in the
    way), and the segment cleanup hits PermissionError: the TE still starts."""
    from deepserve.config.engine import EngineConfig
    from deepserve.engine.te.launcher import TELauncher
    squats = [create_segment(segment_name(run_id, purpose), 64)
              for purpose in ("steps", "kv-r0")]
    launcher = None
    try:
        with monkeypatch.context() as patch:
            _deny_unlink(patch)  # what the launcher (and a sweep) would unlink: refused
            assert not unlink_segment(segment_name(run_id, "steps"))
            cfg = EngineConfig.from_options(str(tiny_model), processes=True, num_kv_blocks=32,
                                            startup_timeout_s=90)
            launcher = TELauncher(cfg, te_id="te-squat", run_id=run_id)
            assert launcher.run_id != run_id and launcher.run_id.startswith(run_id)
            launcher.start()
            assert not launcher.dead()
            assert list_segments(segment_name(launcher.run_id, ""))  # its own ring and pool
            launcher.shutdown()  # its unlinks are refused: logged, not raised
            launcher = None
    finally:
        if launcher is not None:
            launcher.shutdown()
        for shm in squats:
            shm.close()
        for name in list_segments(f"deepserve-{run_id}"):
            unlink_segment(name)
