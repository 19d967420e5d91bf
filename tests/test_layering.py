"""The packages' layer order, read from the source (ast): every import counts, at module
level or inside a function, so that a cycle cannot hide behind a function-local import.

Layers, lowest first; a module imports only its own layer's modules and lower layers':

0. ``memory``: the device runtime (every CUDA call, memory/runtime.py) and the memory pools.
1. ``planes``, ``launch``: infrastructure. Each owns its configuration and errors and
   imports nothing from the other or from above (the device runtime from below).
2. ``dvla`` (the core: config, policy, models, envs, algorithms, rollout, checkpoint, ...).
3. ``swimlane``: the lanes, built from the core and the infrastructure.
4. Entry points: ``dvla.launch``, ``dvla.cli``, ``dvla.report*``.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dvla", "planes", "swimlane", "memory", "launch")
ENTRY_POINTS = ("dvla.launch", "dvla.cli", "dvla.report", "dvla.report_*")
INDEPENDENT = ("planes", "launch")  # one layer, neither imports the other


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules that ``name`` imports anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:  # a name imported from a module -> that module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def layer_of(name: str) -> tuple[int, str]:
    """``(layer, unit)``: modules of one layer may import each other only within a unit."""
    if any(fnmatch.fnmatchcase(name, p) for p in ENTRY_POINTS):
        return 4, "entry"
    top = name.split(".")[0]
    if top == "memory":
        return 0, top
    if top in INDEPENDENT:
        return 1, top
    return (3, "swimlane") if top == "swimlane" else (2, "dvla")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_the_import_walker_sees_function_local_and_relative_imports(tmp_path):
    known = {"pkg": tmp_path / "pkg" / "__init__.py", "pkg.a": tmp_path / "pkg" / "a.py",
             "pkg.b": tmp_path / "pkg" / "b.py", "other": tmp_path / "other.py"}
    (tmp_path / "pkg").mkdir()
    known["pkg.a"].write_text("from . import b\n\ndef f():\n    from other import thing\n    import pkg.b as x\n")
    assert imports_of("pkg.a", known["pkg.a"], known) == {"pkg", "pkg.b", "other"}
    assert layer_of("dvla.report_gantt") == (4, "entry") and layer_of("memory.pools") == (0, "memory")
    assert layer_of("planes.control") == (1, "planes") and layer_of("launch.topology") == (1, "launch")


def test_no_import_goes_against_the_layer_order():
    bad = []
    for src, targets in graph().items():
        ls, us = layer_of(src)
        for dst in targets:
            ld, ud = layer_of(dst)
            if ld > ls or (ld == ls and us != ud):
                bad.append(f"{src} (layer {ls}, {us}) imports {dst} (layer {ld}, {ud})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    # A package's __init__ re-exporting its submodules is not a cycle of its own making:
    # ``dvla.policy`` importing ``dvla`` would be, and shows up here as dvla -> ... -> dvla.
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("pkg", ["swimlane", "planes", "memory", "launch"])
def test_layer_zero_and_swimlane_never_import_the_entry_points(pkg):
    g = graph()
    offenders = {src: sorted(t for t in targets if t in ENTRY_POINTS[:2])
                 for src, targets in g.items() if src.split(".")[0] == pkg}
    assert not {k: v for k, v in offenders.items() if v}
