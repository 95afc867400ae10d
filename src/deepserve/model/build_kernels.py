"""Build the C++ kernels of model/csrc once, at install time, into the venv.

    python -m deepserve.model.build_kernels [--force]

bin/_venv.sh runs this after installing the project; it is a no-op when the
library for the current sources, torch version and flags is already built
(the check imports no torch, so it costs a Python start-up). A TE never
compiles: model/kernels.py loads the library if it exists and otherwise
runs the torch path. The library lives in
<venv>/deepserve-kernels/<tag>/deepserve_ops.so, tag = hash of the sources,
flags and torch version, so a changed source is a new tag (rebuilt by the
next bin/ run), never a stale load.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
from pathlib import Path

NAME = "deepserve_ops"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("ops.cpp", "linear.cpp", "linear_vnni.cpp", "decode_attention.cpp", "elementwise.cpp")
HEADERS = ("simd.h",)
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-std=c++17")


def build_tag() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(importlib.metadata.version("torch").encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    root = os.environ.get("DEEPSERVE_KERNELS_DIR") or str(Path(sys.prefix) / "deepserve-kernels")
    return Path(root) / build_tag() / f"{NAME}.so"


def build(force: bool = False) -> Path:
    """Compile (needs g++ and ninja) unless already built; returns the library path."""
    path = library_path()
    if path.is_file() and not force:
        return path
    from torch.utils.cpp_extension import load

    path.parent.mkdir(parents=True, exist_ok=True)
    load(NAME, [str(CSRC / s) for s in SOURCES], extra_cflags=list(CFLAGS),
         build_directory=str(path.parent), is_python_module=False, verbose=False)
    return path


def main(argv: list[str]) -> int:
    try:
        path = build(force="--force" in argv)
    except Exception as e:  # no compiler, no ninja: the torch path still works
        print(f"deepserve: C++ kernels not built ({type(e).__name__}: {e}); "
              "using the torch path", file=sys.stderr)
        return 0
    print(f"deepserve: kernels at {path}", file=sys.stderr) if "--verbose" in argv else None
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
