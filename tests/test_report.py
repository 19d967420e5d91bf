"""``dvla report``: plots and text summary of a real short swimlane run, and the cases
where parts of a run directory are missing."""

import json
import shutil

import pytest
from PIL import Image

from dvla.config import apply_overrides
from dvla.metrics import read_metrics
from dvla.presets import debug
from dvla.report import main, make_report
from swimlane import Swimlane

ALL_PLOTS = {"success.png", "return.png", "throughput.png", "staleness.png", "lanes.png", "gantt.png",
             "memory.png"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One real 6-update async run shared by the tests of this module (a few seconds)."""
    out = tmp_path_factory.mktemp("report") / "run"
    Swimlane(apply_overrides(debug(), [f"run.out_dir={out}", "run.iterations=6"])).run()
    return out


def check_png(path):
    assert path.is_file(), path
    assert path.stat().st_size > 5 * 1024, (path, path.stat().st_size)
    with Image.open(path) as img:
        assert img.format == "PNG"
        assert img.width > 200 and img.height > 100, (path, img.size)
        colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is None or len(colors) > 10, f"{path.name} is (nearly) a single colour"


def test_report_of_a_real_run(run_dir, tmp_path):
    out = tmp_path / "rep"
    result = make_report(run_dir, out)
    assert {p.name for p in result["pngs"]} == ALL_PLOTS
    for png in result["pngs"]:
        assert png.parent == out
        check_png(png)

    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_metrics(run_dir / "metrics.jsonl")
    text = (out / "summary.txt").read_text()
    assert result["summary"] == text and result["summary_path"] == out / "summary.txt"
    assert f"run length: {len(rows)} updates, {summary['env_steps']} env steps" in text
    assert len(rows) == summary["version"] == 6
    assert f"final {summary['final_success_rate']:.3f}" in text
    best = max(r["success_rate"] for r in rows)
    assert f"best {best:.3f}" in text
    assert f"{summary['env_steps_per_s']:.1f} env steps/s" in text
    acc = summary["chunk_accounting"]
    assert f"consumed {acc['consumed']}, dropped_stale {acc['dropped_stale']}" in text
    assert "unaccounted 0 (ok)" in text
    assert f"chunks: consumed {summary['totals']['chunks_consumed']}" in text
    assert "staleness (versions):" in text and "largest per-update max" in text
    assert f"restarts: {summary['restarts']}" in text
    for lane in ("sampling", "inference", "gradient", "broadcast"):
        assert f"{lane} " in text.split("lane utilisation")[1]
    assert "rank 0 transient peak reserved" in text
    for png in result["pngs"]:
        assert str(png) in text
    assert "skipped:" not in text


def test_main_prints_the_summary_into_the_default_folder(run_dir, capsys):
    assert main([str(run_dir)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"dvla run report: {run_dir}")
    assert f"wrote {run_dir / 'report' / 'summary.txt'}" in printed
    assert f"wrote {run_dir / 'report' / 'gantt.png'}" in printed
    assert (run_dir / "report" / "summary.txt").read_text() in printed


def test_missing_metrics_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "dvla report:" in err and "no metrics.jsonl" in err
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main([str(tmp_path)]) == 2
    assert "no records" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        make_report(tmp_path / "nowhere")
    assert not (tmp_path / "report").exists() or not any((tmp_path / "report").glob("*.png"))


def test_run_without_traces_skips_the_lane_plots(run_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(run_dir, bare, ignore=shutil.ignore_patterns("trace*.json", "report"))
    result = make_report(bare)
    names = {p.name for p in result["pngs"]}
    assert names == ALL_PLOTS - {"lanes.png", "gantt.png"}
    assert not (bare / "report" / "lanes.png").exists() and not (bare / "report" / "gantt.png").exists()
    for png in result["pngs"]:
        check_png(png)
    skipped = result["summary"].split("skipped:")[1]
    assert "lanes.png: no trace" in skipped and "gantt.png: no rank 0 trace" in skipped
    # the summaries still carry the utilisation the run measured
    assert "as recorded in the summaries" in result["summary"]


def test_old_or_partial_run_directory(tmp_path):
    """Missing keys, nulls, a truncated last line, a restart and no summary/trace: what can
    be drawn is drawn, the rest is skipped and named, nothing raises."""
    run = tmp_path / "old"
    run.mkdir()
    rows = []
    for i in range(8):
        t = 0.5 * (i + 1) if i < 5 else 0.4 * (i - 4)  # the logger clock restarts on resume
        rows.append({"iter": i, "time": t, "env_steps": 64.0 * (i + 1),
                     "success_rate": None if i == 3 else i / 8, "env_steps_per_s": 100.0 + i})
    lines = [json.dumps(r) for r in rows] + ['{"iter": 8, "ti']
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    result = make_report(run, tmp_path / "out")
    assert {p.name for p in result["pngs"]} == {"success.png", "throughput.png"}
    text = result["summary"]
    for name in ("return.png", "staleness.png", "lanes.png", "gantt.png", "memory.png"):
        assert f"{name}: " in text.split("skipped:")[1]
    assert "no summary.json" in text
    assert "run length: 8 updates, 512 env steps" in text
    assert "last update at 3.70 s" in text  # 2.5 s before the restart + 1.2 s after it
    assert "best 0.875 (update 7)" in text
    assert "metrics.jsonl line 9: not valid JSON" in text

    # a summary whose chunk books do not balance is flagged
    (run / "summary.json").write_text(json.dumps({
        "mode": "async", "rank": 0, "iterations": 8, "version": 8, "restarts": 1,
        "chunk_accounting": {"consumed": 8, "sent": 11, "received": 11, "unaccounted": 3}}))
    text = make_report(run, tmp_path / "out2")["summary"]
    assert "UNACCOUNTED 3 != 0" in text and "restarts: 1" in text
