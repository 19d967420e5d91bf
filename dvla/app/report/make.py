"""``dvla report RUN_DIR``: plots and a short text summary of a finished (or crashed) run.

Reads what a run leaves in its output directory -- ``metrics.jsonl`` (one row per learner
update), ``summary.json`` / ``summary_rank{N}.json`` (end-of-run counters per rank) and
``trace.json`` / ``trace_rank{N}.json`` (lane spans) -- and writes PNG plots plus
``summary.txt`` into ``RUN_DIR/report`` (or ``--out``). Only ``metrics.jsonl`` is required;
a plot whose data is missing is skipped and the summary says why.

    success.png     success rate vs env steps (raw and smoothed)
    return.png      mean episode return vs env steps
    throughput.png  env steps/s vs wall time (run average as logged, and per update)
    staleness.png   histogram over updates of the per-update staleness (max and mean)
                    plus the cumulative count of chunks dropped as stale
    lanes.png       busy fraction per lane, one bar per rank, from every trace file
    gantt.png       every rank's swimlanes (a block of lane rows per rank) over the last
                    few learner updates, in seconds since the run started
    memory.png      rank 0's pools (reserved / in use) per update, from the mem/* metrics,
                    and every rank's peaks from the summaries

The work is split by responsibility: ``report_data`` (reading the run directory),
``report_plots`` and ``report_gantt`` (the PNGs), ``report_summary`` (the text).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from dvla.app.report.data import Skip, load_config, load_metrics, load_summaries, load_traces
from dvla.app.report.gantt import plot_gantt
from dvla.app.report.plots import (
    plot_autotune,
    plot_balance,
    plot_roles,
    plot_lanes,
    plot_memory,
    plot_return,
    plot_staleness,
    plot_success,
    plot_throughput,
)
from dvla.app.report.summary import summary_text


def make_report(run_dir, out_dir=None) -> dict:
    """Write the plots and ``summary.txt`` for ``run_dir`` into ``out_dir`` (default
    ``run_dir/report``). Returns ``{"pngs": [Path], "summary": str, "summary_path": Path,
    "plots": {name: dict}}``; ``plots`` holds what a drawing function reports about its
    figure (for the Gantt chart and memory: rows, window, ranks; see ``plot_gantt`` and
    ``plot_memory``). Raises ``FileNotFoundError`` when ``run_dir`` has no ``metrics.jsonl``."""
    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run}")
    out = Path(out_dir) if out_dir is not None else run / "report"
    out.mkdir(parents=True, exist_ok=True)

    notes: list[str] = []
    rows = load_metrics(metrics, notes)
    if not rows:
        raise FileNotFoundError(f"{metrics} has no records")
    summaries = load_summaries(run)
    traces = load_traces(run, notes)
    spans = {rank: s for rank, (_, s) in traces.items()}
    config = load_config(run)

    plots: list[tuple[str, Callable[[], Path | dict]]] = [
        ("success.png", lambda: plot_success(rows, out)),
        ("return.png", lambda: plot_return(rows, out)),
        ("throughput.png", lambda: plot_throughput(rows, out)),
        ("staleness.png", lambda: plot_staleness(rows, out)),
        ("lanes.png", lambda: plot_lanes(spans, out)),
        ("gantt.png", lambda: plot_gantt(traces, out, notes)),
        ("memory.png", lambda: plot_memory(rows, summaries, out)),
    ]
    if any("autotune_decisions" in r for r in rows):  # swimlane.autotune ran
        plots.append(("autotune.png", lambda: plot_autotune(rows, out)))
    if sum(k.startswith("speed/rank") for k in set().union(*rows)) > 1:  # several rollout ranks measured
        plots.append(("balance.png", lambda: plot_balance(rows, out)))
    if any("role_switches" in r for r in rows):  # swimlane.roles=adaptive
        plots.append(("roles.png", lambda: plot_roles(rows, out)))
    pngs: list[Path] = []
    info: dict[str, dict] = {}
    skipped: list[str] = []
    for name, draw in plots:
        try:
            drawn = draw()
        except Skip as why:
            skipped.append(f"{name}: {why}")
            continue
        except Exception as exc:  # noqa: BLE001 -- one broken plot should not cost the rest of the report
            skipped.append(f"{name}: failed ({type(exc).__name__}: {exc})")
            continue
        info[name] = drawn if isinstance(drawn, dict) else {"path": drawn}
        pngs.append(Path(info[name]["path"]))

    text = summary_text(run, rows, summaries, spans, config, pngs, skipped, notes)
    summary_path = out / "summary.txt"
    summary_path.write_text(text)
    return {"pngs": pngs, "summary": text, "summary_path": summary_path, "plots": info}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dvla report", description="Plots (PNG) and a text summary of a run "
                                "directory: learning curves, throughput, staleness, lane utilisation, "
                                "a Gantt chart of every rank and memory.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run's output directory (run.out_dir)")
    p.add_argument("--out", metavar="DIR", help="where to write the report (default: RUN_DIR/report)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    run = Path(args.run_dir)
    if not (run / "metrics.jsonl").is_file():
        what = "does not exist" if not run.exists() else "has no metrics.jsonl"
        print(f"dvla report: {run} {what}; pass the run.out_dir of a training run", file=sys.stderr)
        return 2
    try:
        result = make_report(run, args.out)
    except FileNotFoundError as exc:
        print(f"dvla report: {exc}", file=sys.stderr)
        return 2
    print(result["summary"], end="")  # its "plots:" section lists the PNGs written
    print(f"wrote {result['summary_path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
