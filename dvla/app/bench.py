"""``dvla bench``: the scripts in ``bench/`` with their one-line purpose, or one of them run."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def main(argv: list[str]) -> int:
    """``dvla bench``: the scripts in ``bench/`` with their one-line purpose; ``dvla bench
    NAME ARGS`` runs ``bench/NAME.py ARGS`` (``--help`` shows its options)."""
    import ast
    import runpy

    if not BENCH_DIR.is_dir():
        print(f"dvla bench: no bench/ directory next to the dvla package ({BENCH_DIR}); the benchmarks "
              "come with a source checkout (pip install -e .)", file=sys.stderr)
        return 2
    scripts = {p.stem: p for p in sorted(BENCH_DIR.glob("*.py"))}
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: dvla bench NAME [ARGS ...]   (results and commands: bench/RESULTS.md)\n")
        for name, path in scripts.items():
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            print(f"  {name:<16} {doc.splitlines()[0] if doc else ''}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in scripts:
        print(f"dvla bench: unknown benchmark {name!r}; available: {', '.join(scripts)}", file=sys.stderr)
        return 2
    sys.argv = [str(scripts[name]), *rest]
    runpy.run_path(str(scripts[name]), run_name="__main__")
    return 0
