"""bench/gpu_suite.sh, the script to run first on a GPU machine, runs every step tiny on the
CPU (--cpu-smoke), so that it works the day a GPU is there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_suite_smoke_runs_every_step(tmp_path):
    out = tmp_path / "suite.txt"
    proc = subprocess.run([str(ROOT / "bench" / "gpu_suite.sh"), "--cpu-smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    text = out.read_text()
    steps = ["gpu-tests", "colocated", "receiver", "broadcast", "memory", "learner", "overlap", "swimlane", "dataplane"]
    assert all(f"== {s}: exit 0 after" in text for s in steps), text[-3000:]
    for figure in ("ratio dvla/raw =", "ratio bf16/fp32 =", "ratio fsdp-bf16/fp32 =", "ratio streams/default =", "async/sync", "pool/plain"):
        assert figure in text, figure
    assert "0 step(s) failed" in text and text.startswith("dvla gpu_suite ")
    assert "colocated: PASS" in text and "batch_shapes=[16, 32]" in text and "receiver: PASS" in text
