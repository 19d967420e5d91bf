"""``dvla report``: plots and text summary of a real short swimlane run, and the cases
where parts of a run directory are missing."""

import json
import shutil

import pytest
from PIL import Image

from dvla.config import apply_overrides
from dvla.metrics import read_metrics
from dvla.config.presets import debug
from dvla.app.report.make import main, make_report
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
    # the Gantt chart: rank 0's lanes over the last updates, in seconds since the run started
    # (the base of wall_s); the trace carries run_start, so no fallback note
    gantt = result["plots"]["gantt.png"]
    assert gantt["ranks"] == [0]
    assert [lane for _, lane in gantt["lanes"]] == ["sampling", "inference", "gradient", "broadcast"]
    start, end = gantt["window"]
    assert gantt["xlim"] == pytest.approx((start, end))
    assert 0.0 <= start < end <= summary["wall_s"]
    assert "notes:" not in text
    assert result["plots"]["memory.png"]["ranks"] == [0]


def test_main_prints_the_summary_into_the_default_folder(run_dir, capsys):
    assert main([str(run_dir)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"dvla run report: {run_dir}")
    assert f"wrote {run_dir / 'report' / 'summary.txt'}" in printed
    assert (run_dir / "report" / "summary.txt").read_text() in printed
    for name in ALL_PLOTS:  # listed once (under "plots:"), not again as "wrote ..."
        assert printed.count(name) == 1, (name, printed)
    assert f"  {run_dir / 'report' / 'gantt.png'}\n" in printed.split("plots:")[1]


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
    assert "lanes.png: no trace" in skipped and "gantt.png: no trace" in skipped
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


# ----------------------------------------------------------------------------- several ranks, synthetic

RUN_START_UNIX = 1_700_000_000.0
MIB = 2**20


def pool(name, peak_reserved_mib, peak_in_use_mib, budget_mib=None):
    return {"name": name, "reserved_bytes": int(peak_reserved_mib * MIB), "in_use_bytes": 0,
            "requested_bytes": 0, "peak_reserved_bytes": int(peak_reserved_mib * MIB),
            "peak_in_use_bytes": int(peak_in_use_mib * MIB), "allocations": 3, "reuses": 9,
            "budget_bytes": None if budget_mib is None else int(budget_mib * MIB)}


def two_rank_run(run, updates=10, meta=True):
    """A run directory as two ranks leave it: rank 0 learns (update k waits on [k, k+0.6]
    and learns on [k+0.6, k+1.0] s after the run started, then publishes), rank 1 samples
    and infers every 0.5 s and received weights once, at the start. The ranks' perf_counter
    clocks differ (rank 0's run started at 1000.0, rank 1's at 50.0) and rank 1 started
    0.25 s after rank 0 by the wall clock. ``meta=False`` writes old traces (spans relative
    to each tracer's start, no run_start)."""
    from swimlane.observation.trace import Tracer

    run.mkdir()
    rows = [{"iter": k, "time": k + 1.0, "env_steps": 64.0 * (k + 1), "success_rate": k / updates,
             "mem/persistent/reserved_mb": 1.0, "mem/persistent/in_use_mb": 0.9,
             "mem/transient/reserved_mb": 2.0 + 0.1 * k, "mem/transient/in_use_mb": 1.5,
             "mem/transient/budget_mb": 64.0} for k in range(updates)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({
        "mode": "async", "rank": 0, "iterations": updates, "version": updates, "wall_s": updates + 0.2,
        "role": "learner", "memory": {"device": "cpu", "persistent": pool("persistent", 1.0, 0.9),
                                      "transient": pool("transient", 2.9, 1.5, budget_mib=64.0),
                                      "persistent_tensors": []}}))
    (run / "summary_rank1.json").write_text(json.dumps({
        "mode": "async", "rank": 1, "role": "rollout", "wall_s": updates + 0.4,
        "memory": {"device": "cpu", "persistent": pool("persistent", 0.5, 0.5),
                   "transient": pool("transient", 7.0, 6.0)}}))

    t0 = Tracer()
    t0.t0 = 990.0  # the tracer started 10 s before the run (model building, say)
    for k in range(updates):
        t0.add("gradient", "wait", 1000.0 + k, 1000.0 + k + 0.6)
        t0.add("gradient", "learn", 1000.0 + k + 0.6, 1000.0 + k + 1.0)
        t0.add("broadcast", "publish", 1000.0 + k + 1.0, 1000.0 + k + 1.05)
    t1 = Tracer()
    t1.t0 = 45.0
    t1.add("broadcast", "receive", 50.1, 50.2)
    for k in range(2 * updates + 2):
        t1.add("sampling", "sim", 50.0 + 0.5 * k, 50.0 + 0.5 * k + 0.3)
        t1.add("inference", "infer", 50.0 + 0.5 * k + 0.3, 50.0 + 0.5 * k + 0.4)
    if meta:
        t0.save(run / "trace.json", rank=0, mode="async", run_start=1000.0, run_start_unix=RUN_START_UNIX)
        t1.save(run / "trace_rank1.json", rank=1, mode="async", run_start=50.0,
                run_start_unix=RUN_START_UNIX + 0.25)
    else:
        for tracer, name in ((t0, "trace.json"), (t1, "trace_rank1.json")):
            (run / name).write_text(json.dumps({"meta": {"rank": int(name != "trace.json"), "mode": "async"},
                                                "spans": tracer.spans}))
    return run


def test_tracer_saves_its_meta_and_its_time_base(tmp_path):
    from swimlane.observation.trace import Tracer, load_trace

    tr = Tracer()
    tr.t0 = 100.0
    tr.add("gradient", "learn", 105.0, 106.0)
    tr.save(tmp_path / "trace.json", rank=3, mode="sync", run_start=104.0, run_start_unix=RUN_START_UNIX)
    meta, spans = load_trace(tmp_path / "trace.json")
    assert meta == {"t0": 100.0, "rank": 3, "mode": "sync", "run_start": 104.0, "run_start_unix": RUN_START_UNIX}
    assert spans == [("gradient", "learn", 5.0, 6.0)]  # relative to t0; + t0 - run_start: 1.0 s into the run


def test_gantt_draws_every_rank_in_seconds_since_the_run_started(tmp_path):
    from dvla.app.report.data import load_traces
    from dvla.app.report.gantt import align_traces

    run = two_rank_run(tmp_path / "run")
    notes = []
    aligned = align_traces(load_traces(run, notes), notes)
    assert notes == []
    # perf_counter 1000.6 with run_start 1000.0 is 0.6 s into the run; rank 1's clock is
    # shifted by its later start (0.25 s by the wall clock)
    first_learn = min((s for s in aligned[0] if s[1] == "learn"), key=lambda s: s[2])
    assert first_learn[2:] == pytest.approx((0.6, 1.0))
    assert ("broadcast", "receive", pytest.approx(0.35), pytest.approx(0.45)) in aligned[1]
    assert min(s[2] for s in aligned[1] if s[1] == "sim") == pytest.approx(0.25)

    result = make_report(run, tmp_path / "rep")
    gantt = result["plots"]["gantt.png"]
    check_png(tmp_path / "rep" / "gantt.png")
    assert gantt["ranks"] == [0, 1]
    # the last 5 updates: from the end of the 6th-last learn span (5.0 s) to the last one
    # (10.0 s) plus a tenth; rank 1's receive (at 0.35 s) is outside, so it has no row
    assert gantt["window"] == pytest.approx((5.0, 10.5))
    assert gantt["xlim"] == pytest.approx((5.0, 10.5))
    learns = [s for s in aligned[0] if s[1] == "learn" and 5.0 <= s[2] and s[3] <= 10.5]
    assert len(learns) == 5
    assert gantt["lanes"] == [("rank 0", "gradient"), ("rank 0", "broadcast"), ("rank 1", "sampling"),
                              ("rank 1", "inference")]
    # busy share of the window: 5 learn spans of 0.4 s in 5.5 s
    assert gantt["rows"][0] == f"rank 0 · gradient ({2.0 / 5.5:.0%})"
    assert all(r.startswith(f"{lab} · {lane} (") for r, (lab, lane) in zip(gantt["rows"], gantt["lanes"]))
    assert gantt["ylim"] == pytest.approx((3.5, -0.5))  # one row per drawn lane, no empty band
    assert "notes:" not in result["summary"]  # no fallback was needed

    memory = result["plots"]["memory.png"]
    check_png(tmp_path / "rep" / "memory.png")
    assert memory["ranks"] == [0, 1] and memory["rank_labels"] == ["rank 0", "rank 1"]
    assert len(memory["panels"]) == 2 and "Rank 0" in memory["panels"][0]
    assert "rank 1 transient peak reserved 7.00 MiB" in result["summary"]


def test_report_lists_each_plot_once(tmp_path, capsys):
    run = two_rank_run(tmp_path / "run")
    assert main([str(run)]) == 0
    printed = capsys.readouterr().out
    pngs = sorted((run / "report").glob("*.png"))
    assert {p.name for p in pngs} == {"success.png", "throughput.png", "gantt.png", "lanes.png", "memory.png"}
    for png in pngs:
        assert printed.count(png.name) == 1, (png.name, printed)
    assert printed.count("summary.txt") == 1


def test_gantt_of_old_traces_and_short_runs(tmp_path):
    """Traces without run_start (older runs) start at their earliest span; a run with few
    updates is drawn whole."""
    result = make_report(two_rank_run(tmp_path / "old", updates=4, meta=False), tmp_path / "rep")
    gantt = result["plots"]["gantt.png"]
    assert gantt["ranks"] == [0, 1]
    assert gantt["window"][0] == pytest.approx(0.0)  # both files' earliest span
    assert gantt["window"][1] == pytest.approx(0.5 * 9 + 0.4)  # rank 1's last infer span, unshifted
    assert ("rank 1", "broadcast") in gantt["lanes"]  # the whole run: its receive is in
    notes = result["summary"].split("notes:")[1]
    assert "trace.json: no run_start" in notes and "trace_rank1.json: no run_start" in notes


def test_dvla_trace_draw_gantt_still_takes_one_trace(tmp_path):
    from swimlane.observation.trace import draw_gantt, draw_swimlanes

    spans = [("sampling", "sim", 1.0, 2.0), ("gradient", "learn", 2.0, 4.0), ("gradient", "wait", 4.0, 6.0)]
    png = draw_gantt(spans, tmp_path / "g.png", title="dvla swimlane, rank 0", window=(3.0, 6.0))
    assert png == tmp_path / "g.png"
    check_png(png)
    info = draw_swimlanes([("", spans)], tmp_path / "h.png", window=(3.0, 6.0))
    assert info["rows"] == ["gradient (33%)"]  # sampling ended before the window; learn 1 s of 3
    assert info["xlim"] == pytest.approx((3.0, 6.0))


def test_the_moves_are_reported_whichever_ranks_the_last_window_saw(run_dir):
    """A rebalanced run whose last balance window heard from one rollout rank (the straggler
    had handed its groups over and was quiet) still reports its env group moves."""
    from dvla.app.report.summary import summary_text

    summary = json.loads((run_dir / "summary.json").read_text())
    summary["balance"] = {"window_s": 2, "stragglers": [], "by_rank": {"1": {"steps": 640, "sample_s": 2.0}},
                          "moves": [{"version": 12, "src": 2, "dst": 1, "reason": "straggler"}]}
    text = summary_text(run_dir, read_metrics(run_dir / "metrics.jsonl"), {0: summary}, {}, {}, [], [], [])
    assert "rebalancing: 1 env group move(s): v12 rank 2 -> 1" in text, text
