"""Metrics outputs: JSONL always, TensorBoard event files when tensorboard is installed,
and a console progress line with throughput, success, weights version and queue depth."""

import pytest

from dvla.config import apply_overrides
from dvla.metrics import MetricsLogger, read_metrics
from dvla.config.presets import debug
from swimlane import Swimlane


def test_run_writes_tensorboard_scalars_next_to_the_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    Swimlane(apply_overrides(debug(), [f"run.out_dir={out}", "run.iterations=4"])).run()
    rows = read_metrics(out / "metrics.jsonl")
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    events = acc.Scalars("success_rate")
    assert [e.step for e in events] == [1, 2, 3, 4]  # the weights version
    assert [round(e.value, 5) for e in events] == [round(r["success_rate"], 5) for r in rows]
    assert "mem/transient/reserved_mb" in acc.Tags()["scalars"]


def test_tensorboard_off_writes_no_events(tmp_path):
    out = tmp_path / "run"
    Swimlane(apply_overrides(debug(), [f"run.out_dir={out}", "run.iterations=2", "run.tensorboard=false"])).run()
    assert not (out / "tb").exists() and len(read_metrics(out / "metrics.jsonl")) == 2


def test_progress_line_shows_throughput_success_version_and_queue(tmp_path, capsys):
    log = MetricsLogger(tmp_path, total=2, progress=False)
    log.log(0, {"env_steps_per_s": 1234.0, "success_rate": 0.5, "version": 1.0, "queue_depth": 3.0,
                "staleness_mean": 0.25})
    log.close()
    line = capsys.readouterr().out
    for part in ("steps/s=1234", "success=0.50", "v=1", "queue=3", "stale=0.25"):
        assert part in line, line


def test_on_update_sees_every_record_and_a_fresh_run_starts_a_fresh_file(tmp_path):
    out = tmp_path / "run"
    Swimlane(apply_overrides(debug(), [f"run.out_dir={out}", "run.iterations=3"])).run()
    seen = []
    Swimlane(apply_overrides(debug(), [f"run.out_dir={out}", "run.iterations=2"]), on_update=seen.append).run()
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["iter"] for r in rows] == [0, 1]  # not appended to the first run's three rows
    assert seen == rows
