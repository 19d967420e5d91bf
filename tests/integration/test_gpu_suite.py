"""bench/gpu_suite.sh, the further GPU figures (a call after the GPU kit), runs every step
tiny on the CPU (--cpu-smoke), so that it works the day a GPU is there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tests.helpers import ROOT


STEPS = ["broadcast", "overlap", "swimlane", "dataplane"]
FIGURES = ["ratio dvla/raw =", "ratio streams/default =", "async/sync"]


@pytest.mark.slow
def test_the_gpu_suite_smoke_runs_every_step(tmp_path):
    out = tmp_path / "suite.txt"
    proc = subprocess.run([str(ROOT / "bench" / "gpu_suite.sh"), "--cpu-smoke", "--only", ",".join(STEPS),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    text = out.read_text()
    assert all(f"== {s}: exit 0 after" in text for s in STEPS), text[-3000:]
    for figure in FIGURES:
        assert figure in text, figure
    assert "0 step(s) failed" in text and text.startswith("dvla gpu_suite ")
