"""schemathesis (coverage + fuzzing phases, every check) against a real node
on the tiny model (tools/fuzz_api.py): no failure, no 5xx, and the node still
serves a completion afterwards."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts a process tree

ROOT = Path(__file__).resolve().parents[2]


def _fuzz_api():
    spec = importlib.util.spec_from_file_location("fuzz_api", ROOT / "tools" / "fuzz_api.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def test_schemathesis_finds_nothing_on_a_live_node(tiny_model, tmp_path):
    pytest.importorskip("schemathesis")
    fuzz_api = _fuzz_api()
    with fuzz_api.running_node(tiny_model, "tiny", {fuzz_api.FUZZ_KEY: "fuzz"}) as node:
        result = fuzz_api.fuzz(node.url, "tiny", fuzz_api.FUZZ_KEY,
                               fuzz_api.vocab_size_of(tiny_model), out_dir=tmp_path,
                               max_examples=5, seed=1, timeout_s=300)
        assert not node.dead()
    assert result.returncode == 0, result.output[-6000:]
    assert sum(result.statuses.values()) > 300  # it really ran: both phases, every operation
    assert {200, 400, 401, 405} <= set(result.statuses)
    assert result.num_server_errors == 0, result.statuses
    assert result.still_serves
