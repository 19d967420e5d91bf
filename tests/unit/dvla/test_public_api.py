"""The library's surface holds still: every name of ``dvla.__all__`` imports, a module that
moved still imports by its old name (with a warning naming the new one), and a top-level
package of dvla's that another project's shadows stops dvla with one line."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings

import pytest
from tests.helpers import ROOT


def test_every_name_of_the_surface_imports():
    import dvla

    assert len(set(dvla.__all__)) == len(dvla.__all__)
    for name in dvla.__all__:
        assert getattr(dvla, name) is not None, name
        namespace: dict = {}
        exec(f"from dvla import {name}", namespace)  # as a model author writes it
        assert namespace[name] is getattr(dvla, name), name
    with pytest.raises(AttributeError, match="no_such_name"):
        dvla.no_such_name  # noqa: B018


@pytest.mark.parametrize("old", ["dvla.presets", "dvla.checkpoint", "dvla.sft_learner", "dvla.report"])
def test_a_moved_module_imports_by_its_old_name_and_warns(old):
    from dvla._imports import MOVED

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.import_module(MOVED[old])  # the new name: no warning


def test_a_shadowing_launch_package_stops_dvla_with_one_line(tmp_path):
    """ROS 2's ``launch`` first on PYTHONPATH: ``python -m dvla.launch`` from another directory
    prints one line naming both packages and the remedy, and exits non-zero."""
    ros = tmp_path / "ros" / "site-packages"
    (ros / "launch").mkdir(parents=True)
    (ros / "launch" / "__init__.py").write_text("LaunchDescription = object\n")
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ros), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "dvla.launch", "--print-config"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(ros / "launch") in lines[0] and str(ROOT / "launch") in lines[0], lines[0]
    assert "PYTHONPATH" in lines[0] and "'launch'" in lines[0], lines[0]
    # the same command without the shadow prints the config
    env["PYTHONPATH"] = str(ROOT)
    ok = subprocess.run([sys.executable, "-m", "dvla.launch", "--print-config"], cwd=elsewhere, env=env,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "run:" in ok.stdout, ok.stderr[-2000:]
