"""Stop signals on a 3-rank torchrun job (issue #47, 3): SIGTERM to rank 0 alone, SIGTERM to
every rank at once (what Slurm and Kubernetes do), SIGINT to a rollout rank alone, and on a
job of two (sharded) learners SIGTERM to the second learner alone. Each ends
the whole job with a checkpoint and exit 0: rank 0 says where to continue from, no other rank
says anything, no traceback. One job after the other, each resuming the one before, so the
test also sees that every stop's checkpoint continues the run without a gap."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dvla.metrics import read_metrics
from dvla.state.checkpoint import CheckpointManager
from tests.helpers.ranks import torchrun_workers

# (signal, ranks, the job's run name and its overrides): one job after the other, each
# resuming the one before it of the same name. The last is a job of two learners (ranks 0 and
# 1, which also sample, average their gradients every step): SIGTERM to the second alone.
ONE_LEARNER = ("job", ())
TWO_LEARNERS = ("learners", ("swimlane.learner_ranks=2", "swimlane.colocate=true"))
PATTERNS = [(signal.SIGTERM, [0], ONE_LEARNER), (signal.SIGTERM, [0, 1, 2], ONE_LEARNER),
            (signal.SIGINT, [1], ONE_LEARNER), (signal.SIGTERM, [1], TWO_LEARNERS)]


def _rows(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_a_signal_at_one_rank_or_all_stops_the_job_with_a_checkpoint_and_exit_0(tmp_path):
    started: set[str] = set()
    for sig, ranks, (name, overrides) in PATTERNS:
        out = tmp_path / name
        metrics = out / "metrics.jsonl"
        before = _rows(metrics)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
               "-m", "dvla.launch", "--preset", "debug", "run.torch_threads=1", "run.tensorboard=false",
               "swimlane.colocate=false", "run.iterations=100000", "run.save_every=0",
               "policy.options.learn_wait_ms=50", f"run.out_dir={tmp_path}", f"run.name={name}", *overrides,
               *(["--resume"] if name in started else [])]
        started.add(name)
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while _rows(metrics) < before + 2 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            workers = torchrun_workers(proc.pid)
            assert sorted(workers) == [0, 1, 2], workers
            for r in ranks:
                os.kill(workers[r], sig)
            text = proc.communicate(timeout=120)[0]
        finally:
            if proc.poll() is None:  # torchrun and its ranks
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        what = f"{sig.name} to rank(s) {ranks} of {name}"
        assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{text[-5000:]}"
        assert "Traceback" not in text and "error" not in text.lower(), f"{what}\n{text[-5000:]}"
        stopped = [ln for ln in text.splitlines() if ln.startswith("stopped by ")]
        assert len(stopped) == 1 and stopped[0].startswith(f"stopped by {sig.name} at rank "), f"{what}\n{text[-3000:]}"
        summary = json.loads((out / "summary.json").read_text())
        ck = CheckpointManager(out / "checkpoints").list()[-1]
        assert int(ck.name.split("-")[1]) == summary["version"] and f"checkpoint {ck}" in stopped[0], (what, stopped)
        assert [r["iter"] for r in read_metrics(metrics)] == list(range(summary["version"])), what
        assert summary["version"] >= before + 2
