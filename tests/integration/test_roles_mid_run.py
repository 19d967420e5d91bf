"""A rank moves between rollout and learning while a torchrun job runs (``swimlane.roles=
adaptive``), the switches following the run's own phases."""

from __future__ import annotations

import pytest


def _follow_metrics(path, proc, want, deadline_s: float = 240.0) -> list[dict]:
    """The rows of ``path`` (a metrics file a run writes), read as they come until one
    satisfies ``want`` (returned: every row so far); fails if the run ends or the deadline
    passes first."""
    import json
    import time

    rows, seen = [], 0
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if path.exists():
            lines = path.read_text().split("\n")
            for line in lines[seen:-1]:  # (the last piece: a line still being written, or "")
                rows.append(json.loads(line))
                if want(rows[-1]):
                    return rows
            seen = max(seen, len(lines) - 1)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    out = proc.communicate(timeout=60)[0] if proc.poll() is not None else ""
    raise AssertionError(f"the run {'ended' if out else 'ran on'} before the awaited row; "
                         f"last rows {rows[-3:]}\n{out[-4000:]}")


@pytest.mark.slow
def test_a_rank_moves_between_rollout_and_learning_mid_run(tmp_path):
    """Three processes under torchrun: rank 0 learns, rank 1 is a candidate, and all three
    sample. Phase one: learning is the bottleneck (each learning forward pass waits), and the
    test waits until rank 1 has joined the learners at a published version. Then the test
    makes sampling the bottleneck (every env's renders wait while a phase file exists) and
    waits until rank 1 has gone back to sampling; removes the file and lets the run end. No
    deadlock; both learner ranks end with the same weights (the masked average keeps them
    one); every chunk is accounted for on both. The phases are the run's own events, seen in
    its metrics, so the switches do not hang on measured times that other load blurs (the
    waits use no core)."""
    import json
    import os
    import subprocess
    import sys

    from dvla.app.report.make import make_report
    from dvla.metrics import read_metrics

    run, phase = tmp_path / "roles", tmp_path / "sampling-is-slow"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           "-m", "dvla.launch", "--preset", "debug", "run.torch_threads=1", "run.tensorboard=false",
           "swimlane.learner_ranks=2", "swimlane.roles=adaptive", "swimlane.balance_window_s=1",
           "swimlane.broadcast_every=2", "swimlane.max_staleness=2", "algo.update_epochs=1", "env.n_envs=4",
           "env.episode_len=4", "policy.options.learn_wait_ms=300", f"env.options.phase_file={phase}",
           "env.options.render_wait_ms_after=300", "run.iterations=24",
           f"run.out_dir={tmp_path}", "run.name=roles"]
    with subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        try:
            joined = _follow_metrics(run / "metrics.jsonl", proc, lambda r: r.get("role/rank1") == 1.0)
            phase.touch()  # sampling is now the bottleneck
            _follow_metrics(run / "metrics.jsonl", proc,
                            lambda r: r["iter"] > joined[-1]["iter"] and r.get("role/rank1") == 0.0)
            phase.unlink()
            out = proc.communicate(timeout=240)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out[-4000:]
    lead, cand = (json.loads((run / name).read_text()) for name in ("summary.json", "summary_rank1.json"))
    assert lead["version"] == cand["version"] == 24
    switches = lead["balance"]["roles"]["switches"]
    assert [(w["rank"], w["to"]) for w in switches[:2]] == [(1, "learner"), (1, "rollout")], switches
    assert all(w["version"] % 2 == 0 for w in switches)  # only at published versions
    assert cand["weights_digest"] == lead["weights_digest"]
    assert cand["totals"]["chunks_consumed"] > 0 and cand["totals"]["updates_sat_out"] > 0
    for s in (lead, cand):
        assert s["chunk_accounting"]["unaccounted"] == 0, s["chunk_accounting"]
        assert not any(v for k, v in s["totals"].items() if k.startswith("rejected_")), s["totals"]
    rows = read_metrics(run / "metrics.jsonl")
    assert {r["role/rank1"] for r in rows} == {0.0, 1.0} and {r["groups/rank1"] for r in rows} >= {0.0, 2.0}
    report = make_report(run)
    assert "roles.png" in report["plots"] and "roles: " in report["summary"]
