"""The floors of ../shared/DESIGN.md, enforced on the source: a room imports
only from its own room or a lower floor, and no file under src/ passes 400
lines. Every import statement counts, also those inside functions and under
TYPE_CHECKING: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from deepserve import _EXPORTS

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "deepserve"
MAX_LINES = 400

# The floor table (room -> floor) and the forbidden imports live in
# tools/architecture.py, which docs/architecture.md is generated from too.
sys.path.insert(0, str(ROOT / "tools"))  # tools/ is no package
from architecture import FLOORS, FORBIDDEN  # noqa: E402


def room_of_path(path: Path, root: Path) -> str | None:
    parts = path.relative_to(root).parts
    if parts == ("__init__.py",):
        return None  # the package facade: lazy public names, no room
    return parts[0] if len(parts) > 1 else Path(parts[0]).stem


def room_of_module(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "deepserve" or len(parts) < 2:
        return None
    return parts[1]


def imported_modules(tree: ast.AST, path: Path, root: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package of `path`
                base = list(path.relative_to(root.parent).with_suffix("").parts)
                base = base[:len(base) - node.level]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            if module == "deepserve":  # from deepserve import engine / LLM (the facade)
                found += [(node.lineno, _EXPORTS.get(a.name, f"deepserve.{a.name}"))
                          for a in node.names]
    return found


def violations(path: Path, root: Path = SRC) -> list[str]:
    room = room_of_path(path, root)
    if room is None:
        return []
    assert room in FLOORS, f"{path}: room {room!r} has no floor (add it to FLOORS in tools/architecture.py)"
    bad = []
    for lineno, module in imported_modules(ast.parse(path.read_text()), path, root):
        target = room_of_module(module)
        if target is None or target == room:
            continue
        assert target in FLOORS, f"{path}:{lineno}: unknown room {target!r}"
        if target in FORBIDDEN.get(room, set()):
            bad.append(f"{path.relative_to(root)}:{lineno}: {room} must not import {module}")
        elif FLOORS[target] > FLOORS[room]:
            bad.append(f"{path.relative_to(root)}:{lineno}: {room} (floor {FLOORS[room]}) "
                       f"imports {module} (floor {FLOORS[target]})")
    return bad


SOURCES = sorted(SRC.rglob("*.py"))


def test_no_module_imports_upward():
    bad = [line for path in SOURCES for line in violations(path)]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_source_file_passes_the_line_limit():
    long = {str(p.relative_to(SRC)): n for p in SOURCES
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("source, expected", [
    ("from deepserve.engine.te.master import Master\n", "must not import"),
    ("import deepserve.drill.load\n", "floor 5"),
    ("def f():\n    from deepserve.worker import sampler\n", "floor 2"),
])
def test_the_checker_catches_an_upward_import(tmp_path, source, expected):
    """The rule can fail: a control module importing the engine, a cache
    module importing drill, a lazy import of the worker from the cache."""
    root = tmp_path / "deepserve"
    room = "control" if "engine" in source else "cache"
    (root / room).mkdir(parents=True)
    path = root / room / "bad.py"
    path.write_text(source)
    assert any(expected in line for line in violations(path, root))


def test_one_host_needs_no_ray():
    """Ray is the optional `cluster` extra: a node, its children and the drills
    import without it; only supervisor/ray_fabric.py asks for it, when run."""
    code = ("import sys; import deepserve.supervisor.__main__, deepserve.supervisor.node, "
            "deepserve.engine.te.te_server, deepserve.control.je.job_executor, "
            "deepserve.control.cm.cluster_manager, deepserve.gateway.__main__, "
            "deepserve.drill.__main__, deepserve.supervisor.ray_fabric; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]"
