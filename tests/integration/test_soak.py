"""Soak: two fast rollout ranks feed a deliberately slow learner over the real planes
(admission by weights version loosened with a large ``max_staleness``, so nothing but
the data plane holds the rollout ranks back)
for about 110 s, so the data plane is under backpressure most of the time. The learner is
slow by waiting (``learn_wait_ms``: each learning forward pass waits a quarter second without a
core, a learner on hardware of its own) rather than by computing 30 epochs: blocked senders
and a waiting learner leave the CPU to the rest of the suite (27 s of CPU instead of the whole
machine for two minutes), and the receive queue is as full. Memory must
stay bounded: once warmed up (``WARMUP_S``; the highest resident set over the next 15 s
is the plateau), no worker's resident set rises more than ``RSS_GROWTH_BOUND`` above its
plateau for the rest of the run, and every chunk sent is accounted for at the end.

Measured (2 cores): the rollout ranks stay flat within 1 MiB. The learner's resident set
rises and falls as glibc grows and trims its arenas, and its peaks still crept up by
about 30-55 MiB over the 85 s after the plateau of a 150 s run (the run was shortened
to 110 s to keep the suite's time in bounds); the bound leaves room for that creep,
whose cause (allocator fragmentation or a slow leak) is not yet known."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dvla.metrics import read_metrics

SOAK_S = 110
WARMUP_S = 45
RSS_GROWTH_BOUND = 96 << 20


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _workers(agent: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent:
                    out.append(int(p.name))
            except OSError:
                pass
    return out


@pytest.mark.slow
def test_soak_under_backpressure_keeps_memory_bounded(tmp_path):
    out = tmp_path / "soak"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           "-m", "dvla.launch", "--preset", "fast_reach", "run.iterations=1000000", f"run.time_limit_s={SOAK_S}",
           "env.image_size=32", "env.n_envs=32", "swimlane.colocate=false", "swimlane.queue_size=2",
           "policy.options.learn_wait_ms=250", "swimlane.max_staleness=50", "swimlane.trace=false", "run.progress=false",
           "run.torch_threads=1", "run.tensorboard=false", f"run.out_dir={out.parent}", f"run.name={out.name}"]
    log = open(tmp_path / "soak.log", "w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    samples: dict[int, list[tuple[float, int]]] = {}
    t0 = time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - t0 < SOAK_S + 120:
            now = time.monotonic() - t0
            for pid in _workers(proc.pid):
                rss = _rss(pid)
                if rss is not None:
                    samples.setdefault(pid, []).append((now, rss))
            time.sleep(1.0)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert rc == 0, (tmp_path / "soak.log").read_text()[-5000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["time_limit_reached"] and summary["chunk_accounting"]["unaccounted"] == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) > 20
    # Backpressure: the learner's receive queue was full (queue_size) most of the run.
    full = sum(r["queue_depth"] >= 2 for r in rows)
    assert full > len(rows) // 2, (full, len(rows))

    assert len(samples) == 3
    for pid, series in samples.items():
        plateau = [rss for t, rss in series if WARMUP_S <= t < WARMUP_S + 15]
        later = [rss for t, rss in series if t >= WARMUP_S + 15]
        assert len(plateau) > 5 and len(later) > 20, series
        growth = max(later) - max(plateau)
        assert growth < RSS_GROWTH_BOUND, (pid, growth >> 20, [(round(t), r >> 20) for t, r in series[::5]])
