"""Denormals as zero for the model's compute, not for the process's Python
(model/kernels.py: start_flushing_denormals, denormals_flushed).

Checked in a fresh interpreter: the mode reaches torch's intra-op threads
only if it is on when they start, which in the test process happened long ago.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, torch
from deepserve.model import kernels
torch.set_num_threads(2)
kernels.start_flushing_denormals()
tiny = 1e-39  # a denormal float32
x = torch.full((1 << 20,), tiny)
out = {"python_sees_denormal": 5e-324 > 0.0,
       "main_outside": (torch.tensor([tiny]) * 1.0).item(),
       "threads": torch.get_num_threads(),
       "parallel_zero_share": ((x * 1.0) == 0).float().mean().item()}
with kernels.denormals_flushed():
    out["main_inside"] = (torch.tensor([tiny]) * 1.0).item()
    out["python_inside"] = 5e-324 > 0.0
out["main_after"] = (torch.tensor([tiny]) * 1.0).item()
print(json.dumps(out))
"""


def test_denormals_flush_in_the_model_only():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, check=True)
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["python_sees_denormal"] and r["main_outside"] > 0 and r["main_after"] > 0
    assert r["main_inside"] == 0.0  # the forward pass's thread: as zero
    assert r["python_inside"] is False  # why it is only on around the forward pass
    if r["threads"] > 1:  # the other intra-op threads flush for good: their share is 0
        assert 0.0 < r["parallel_zero_share"] < 1.0
