"""The packages' layer order, read from the source (ast): every import counts, at module
level or inside a function, so that a cycle cannot hide behind a function-local import.

The layers come from the package structure, lowest first; a module imports only its own
layer's modules and lower layers':

0. ``memory``: the device runtime (every CUDA call, memory/runtime.py) and the memory pools.
1. ``planes``, ``launch``: infrastructure. Each owns its configuration and errors and
   imports nothing from the other or from above (the device runtime from below).
2. ``dvla``, the library: every module of the package but its applications.
3. ``swimlane``, built from the library and the infrastructure, in layers of its own
   sub-packages: ``observation`` (trace, ledger, health, throughput, status); ``agreement`` |
   ``adaptation`` (learners' one state and one order of collectives | autotune, rebalancing,
   roles); ``lanes`` (the lanes and what they pass); ``assembly`` (plan, builders, wiring,
   lifecycle); the package itself (its public names).
4. ``dvla.app``: the applications (one per command), and the runnable modules that hand over
   to them (a module of the library with an ``if __name__ == "__main__"`` block:
   ``dvla.launch``, ``dvla.cli``).

A module belongs to the longest package of :data:`LAYERS` that holds it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from tests.helpers import ROOT

APP = "dvla.app"
# Lowest first; the packages of one layer are independent of each other.
LAYERS = (("memory",), ("planes", "launch"), ("dvla",), ("swimlane.observation",),
          ("swimlane.agreement", "swimlane.adaptation"), ("swimlane.lanes",), ("swimlane.assembly",), ("swimlane",),
          (APP,))
TOP = ("memory", "planes", "launch", "dvla", "swimlane")


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in TOP:
        for path in (root / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
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


def runnable(path: Path) -> bool:
    """Whether the module runs as a program (``if __name__ == "__main__":``)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__":
            return True
    return False


def layer_of(name: str, path: Path) -> tuple[int, str]:
    """``(layer, unit)``: modules of one layer may import each other only within a unit (a
    package of :data:`LAYERS`)."""
    if name.startswith("dvla.") and runnable(path):
        name = APP
    best = max((pkg for layer in LAYERS for pkg in layer if name == pkg or name.startswith(pkg + ".")), key=len)
    layer = next(i for i, pkgs in enumerate(LAYERS) if best in pkgs)
    return layer, "app" if best == APP else best


def violations(root: Path) -> tuple[list[str], list[list[str]]]:
    """``(imports against the layer order, import cycles)`` of the tree at ``root``."""
    known = modules(root)
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    bad = []
    for src, targets in graph.items():
        ls, us = layer_of(src, known[src])
        for dst in targets:
            ld, ud = layer_of(dst, known[dst])
            if ld > ls or (ld == ls and us != ud):
                bad.append(f"{src} (layer {ls}, {us}) imports {dst} (layer {ld}, {ud})")
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return sorted(bad), cycles


def test_the_import_walker_sees_function_local_and_relative_imports(tmp_path):
    known = {"pkg": tmp_path / "pkg" / "__init__.py", "pkg.a": tmp_path / "pkg" / "a.py",
             "pkg.b": tmp_path / "pkg" / "b.py", "other": tmp_path / "other.py"}
    (tmp_path / "pkg").mkdir()
    known["pkg.a"].write_text("from . import b\n\ndef f():\n    from other import thing\n    import pkg.b as x\n")
    assert imports_of("pkg.a", known["pkg.a"], known) == {"pkg", "pkg.b", "other"}


def test_the_layers_follow_the_package_structure():
    known = modules(ROOT)
    app = len(LAYERS) - 1
    assert layer_of("dvla.app.report.gantt", known["dvla.app.report.gantt"]) == (app, "app")
    assert layer_of("dvla.launch", known["dvla.launch"]) == (app, "app")  # runnable: torchrun's module
    assert layer_of("dvla.state.checkpoint", known["dvla.state.checkpoint"]) == (2, "dvla")
    assert layer_of("memory.pools", known["memory.pools"]) == (0, "memory")
    assert layer_of("planes.control", known["planes.control"]) == (1, "planes")
    assert layer_of("launch.topology", known["launch.topology"]) == (1, "launch")
    assert layer_of("swimlane.lanes.sampling", known["swimlane.lanes.sampling"]) == (5, "swimlane.lanes")
    assert layer_of("swimlane.adaptation.roles", known["swimlane.adaptation.roles"])[0] == \
        layer_of("swimlane.agreement.ordering", known["swimlane.agreement.ordering"])[0] == 4


def test_no_import_goes_against_the_layer_order_and_none_makes_a_cycle():
    bad, cycles = violations(ROOT)
    assert not bad, "\n".join(bad)
    # A package's __init__ re-exporting its submodules is not a cycle of its own making:
    # ``dvla.policy`` importing ``dvla`` would be, and shows up here as dvla -> ... -> dvla.
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for pkg in ("memory", "planes", "launch", "swimlane", "dvla", "dvla/app", "dvla/state"):
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").touch()
    for rel, text in files.items():
        (root / rel).write_text(text)
    return root


def test_a_planted_upward_import_and_a_planted_cycle_are_caught(tmp_path):
    clean = _tree(tmp_path / "clean", {"dvla/state/disk.py": "import memory\n",
                                       "dvla/app/run.py": "from dvla.state import disk\nimport swimlane\n",
                                       "dvla/launch.py": "from dvla.app.run import x\nif __name__ == '__main__':\n"
                                                         "    x()\n"})
    assert violations(clean) == ([], [])
    upward = _tree(tmp_path / "up", {"dvla/state/disk.py": "def f():\n    from dvla.app import run\n",
                                     "dvla/app/run.py": ""})
    assert violations(upward)[0] == ["dvla.state.disk (layer 2, dvla) imports dvla.app (layer 8, app)",
                                     "dvla.state.disk (layer 2, dvla) imports dvla.app.run (layer 8, app)"]
    cycle = _tree(tmp_path / "cycle", {"dvla/state/a.py": "from dvla.state import b\n",
                                       "dvla/state/b.py": "def f():\n    import dvla.state.a\n"})
    assert violations(cycle)[1] == [["dvla.state.a", "dvla.state.b", "dvla.state.a"]]


def test_no_main_outside_the_applications():
    """A command's ``main()`` lives in ``dvla.app``: the library and the lower packages define
    none (a runnable module hands over to an application's)."""
    defined = []
    for name, path in modules(ROOT).items():
        if name.startswith(APP + ".") or name == APP:
            continue
        tree = ast.parse(path.read_text())
        defined += [f"{name}.main" for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"]
    assert not defined, defined


@pytest.mark.parametrize("pkg", ["swimlane", "planes", "memory", "launch"])
def test_no_lower_package_imports_an_application(pkg):
    known = modules(ROOT)
    offenders = {src: sorted(t for t in imports_of(src, path, known) if layer_of(t, known[t])[1] == "app")
                 for src, path in known.items() if src.split(".")[0] == pkg}
    assert not {k: v for k, v in offenders.items() if v}
