"""How dvla's own packages are found, checked before anything else of dvla is imported
(``dvla/__init__.py`` calls both):

* :func:`check_top_level`: dvla's top-level packages (``planes``, ``swimlane``, ``memory``,
  ``launch``) are generic names, and another project's package of the same name may come
  first on ``sys.path`` (ROS 2 ships a Python package ``launch``, and ROS users have it on
  ``PYTHONPATH`` ahead of site-packages). Then dvla stops with one line naming both paths and
  the remedy, instead of failing later on a missing name.
* :func:`install`: modules that moved when ``dvla/`` was cut into sub-packages by concern are
  still importable by their old names; each gives the module at its new place and warns
  (``DeprecationWarning``) naming that place.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from pathlib import Path

TOP_LEVEL = ("planes", "swimlane", "memory", "launch")  # beside dvla/, installed with it

MOVED = {
    "dvla.presets": "dvla.config.presets",
    "dvla.config_doc": "dvla.config.reference",
    "dvla.contract_checks": "dvla.contract.checks",
    "dvla.episodes": "dvla.rollout.episodes",
    "dvla.segments": "dvla.rollout.segments",
    "dvla.checkpoint": "dvla.state.checkpoint",
    "dvla.train_state": "dvla.state.train_state",
    "dvla.init_weights": "dvla.state.init_weights",
    "dvla.atomic_io": "dvla.state.atomic_io",
    "dvla.rundir": "dvla.state.rundir",
    "dvla.sharding": "dvla.distributed.sharding",
    "dvla.eval_stats": "dvla.evaluation.stats",
    "dvla.sft_learner": "dvla.algos.imitation",
    "dvla.sft_data": "dvla.datasets.frames",
    "dvla.sft_state": "dvla.app.sft.checkpoints",
    "dvla.sft": "dvla.app.sft",
    "dvla.report": "dvla.app.report",
    "dvla.report_data": "dvla.app.report.data",
    "dvla.report_gantt": "dvla.app.report.gantt",
    "dvla.report_plots": "dvla.app.report.plots",
    "dvla.report_summary": "dvla.app.report.summary",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.new}: import it from there", DeprecationWarning, stacklevel=4)
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        pass  # the module at its new place is complete


class MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        new = MOVED.get(name)
        return importlib.util.spec_from_loader(name, _Alias(new)) if new is not None else None


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())


class ShadowedPackageError(ImportError):
    """One of dvla's top-level packages resolves to another project's package."""


def _origin(name: str) -> Path | None:
    module = sys.modules.get(name)
    if module is not None:
        file = getattr(module, "__file__", None)
        return Path(file).resolve() if file else None
    spec = importlib.util.find_spec(name)  # a top-level name: finds, imports nothing
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
        return Path(spec.origin).resolve()
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]).resolve() / "__init__.py" if locations else None


def check_top_level(root: Path) -> None:
    """Raise :class:`ShadowedPackageError` (one line) when a top-level package of dvla's is not
    the one installed beside ``root`` (the directory that holds ``dvla/``)."""
    for name in TOP_LEVEL:
        want = (root / name / "__init__.py").resolve()
        got = _origin(name)
        if got != want:
            raise ShadowedPackageError(
                f"dvla: the package {name!r} resolves to {got.parent if got else 'nothing'}, not dvla's own "
                f"{want.parent}: another package named {name!r} comes first on sys.path (ROS 2's 'launch' on "
                f"PYTHONPATH, for one); remove its directory from PYTHONPATH or run dvla from an environment "
                f"without it", name=name)


def one_line_hook(previous):
    """A ``sys.excepthook`` that prints a :class:`ShadowedPackageError` that nothing caught as its
    one line (a program that imports dvla: ``dvla``, ``python -m dvla.launch``, torchrun's
    ranks), and leaves every other exception to ``previous``."""
    def hook(kind, value, tb):
        if isinstance(value, ShadowedPackageError):
            print(value, file=sys.stderr)
        else:
            previous(kind, value, tb)
    return hook
