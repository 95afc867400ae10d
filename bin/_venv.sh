# Sourced by bin/ scripts: make sure .venv exists and holds the project.
# Usage: DEEPSERVE_EXTRA=test . bin/_venv.sh   -> sets $ROOT and $PY
# (a variable, not an argument: a sourced script sees the caller's "$@")
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
_extra="${DEEPSERVE_EXTRA:-}"
if [ ! -x "$PY" ]; then
    echo "deepserve: creating $VENV" >&2
    python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
fi
# torch only when missing: a bare 'torch' requirement could pull a multi-GB
# CUDA build; 2.13.0 is the CPU wheel this kind of machine keeps on disk.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
_stamp="$VENV/.deepserve-installed${_extra:+-$_extra}"
if [ ! -f "$_stamp" ] || [ "$ROOT/setup.cfg" -nt "$_stamp" ]; then
    _spec="$ROOT"; [ -n "$_extra" ] && _spec="$ROOT[$_extra]"
    "$PY" -m pip install -q -e "$_spec"
    touch "$_stamp"
fi
# The C++ kernels (src/deepserve/model/csrc), built once per source version
# into the venv: a no-op that imports no torch when they are built already;
# without a compiler the project runs on the torch path.
"$PY" -m deepserve.model.build_kernels
