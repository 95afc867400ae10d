"""What a TE's start imports: one torch import per TE (its forkserver's),
none in the TE server or pre-warmed pod, and no torch._dynamo anywhere
(issue 25 item 6: a pod warm in seconds under load). Each check runs in a
fresh interpreter, as the node starts these processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_te_server_and_pod_import_no_torch(tiny_model):
    # everything the TE server (and a pod before its Assign) runs, including
    # the launcher's specs and the model config it resolves block sizes from
    out = _run("import sys\n"
               "import deepserve.engine.te.te_server, deepserve.engine.te.prewarmed\n"
               "from deepserve.model.config import load_model_config\n"
               f"c = load_model_config({str(tiny_model)!r}, 'bfloat16')\n"
               "print(c.kv_bytes_per_block(16), 'torch' in sys.modules)")
    nbytes, imported = out.split()
    assert imported == "False"
    assert int(nbytes) > 0


def test_model_config_dtype_is_torch_dtype_when_asked(tiny_model):
    out = _run("from deepserve.model.config import load_model_config\n"
               f"c = load_model_config({str(tiny_model)!r}, 'bfloat16')\n"
               "import torch\n"
               "print(c.dtype is torch.bfloat16, c.kv_bytes_per_block(16) == "
               "2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * torch.bfloat16.itemsize)")
    assert out == "True True"


def test_loading_a_model_does_not_import_dynamo(tiny_model):
    # the meta-device init of nn.Embedding used to import torch._dynamo
    # (~1.2 s per worker process on 2 cores) for values the loader overwrites
    out = _run("import sys\n"
               "from deepserve.model.loader import load_model\n"
               f"m = load_model({str(tiny_model)!r})\n"
               "print('torch._dynamo' in sys.modules, m.embed_tokens.weight.device)")
    assert out == "False cpu"
