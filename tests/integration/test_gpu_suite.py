"""bench/gpu_suite.sh, the script to run first on a GPU machine, runs every step tiny on the
CPU (--cpu-smoke), so that it works the day a GPU is there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tests.helpers import ROOT


HALVES = {"first": ["colocated", "receiver", "broadcast", "memory"],
          "second": ["learner", "overlap", "swimlane", "dataplane"]}
FIGURES = {"first": ["ratio dvla/raw =", "pool/plain", "colocated: PASS", "batch_shapes=[16, 32]", "receiver: PASS"],
           "second": ["ratio bf16/fp32 =", "ratio fsdp-bf16/fp32 =", "ratio streams/default =", "async/sync"]}


@pytest.mark.slow
@pytest.mark.parametrize("half", sorted(HALVES))
def test_the_gpu_suite_smoke_runs_every_step(tmp_path, half):
    """Each half of the steps in a test of its own (``--only``), so that the two run side by
    side on two workers."""
    out = tmp_path / "suite.txt"
    steps = HALVES[half]
    proc = subprocess.run([str(ROOT / "bench" / "gpu_suite.sh"), "--cpu-smoke", "--only", ",".join(steps),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    text = out.read_text()
    assert all(f"== {s}: exit 0 after" in text for s in steps), text[-3000:]
    others = [s for h in HALVES.values() for s in h if s not in steps]
    assert not any(f"== {s}:" in text for s in others), text[-3000:]  # --only runs only those
    for figure in FIGURES[half]:
        assert figure in text, figure
    assert "0 step(s) failed" in text and text.startswith("dvla gpu_suite ")
    assert "== gpu-tests: no CUDA here, skipped" in text
