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
    gantt.png       rank 0's swimlane Gantt chart over the last few seconds of its trace
    memory.png      pool memory (reserved / in use) per update, when mem/* metrics exist
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

GANTT_LAST_S = 3.0
_DPI = 110


class _Skip(Exception):
    """A plot has no data to draw; the message says what is missing."""


# ----------------------------------------------------------------------------- loading


def _num(v: Any) -> float | None:
    """A finite float, or None for null / missing / non-numeric / non-finite values."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _rank_of(path: Path, meta: dict | None = None) -> int:
    if meta and isinstance(meta.get("rank"), int):
        return meta["rank"]
    m = re.search(r"_rank(\d+)\.json$", path.name)
    return int(m.group(1)) if m else 0


def _load_summaries(run: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    files = ([run / "summary.json"] if (run / "summary.json").exists() else []) + sorted(run.glob("summary_rank*.json"))
    for f in files:
        data = _read_json(f)
        if data is not None:
            out.setdefault(_rank_of(f, data), data)
    return dict(sorted(out.items()))


def _load_traces(run: Path, notes: list[str]) -> dict[int, list[tuple[str, str, float, float]]]:
    from swimlane.trace import load_trace

    out: dict[int, list] = {}
    for f in sorted(run.glob("trace*.json")):
        try:
            meta, spans = load_trace(f)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            notes.append(f"{f.name}: unreadable trace ({type(exc).__name__}: {exc}), ignored")
            continue
        out.setdefault(_rank_of(f, meta), spans)
    return dict(sorted(out.items()))


def _load_config(run: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load((run / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):  # optional context only
        return {}
    return data if isinstance(data, dict) else {}


def _wall_time(rows: list[dict]) -> list[float | None]:
    """Seconds since the run started, continuous across restarts (each attempt's logger
    restarts ``time`` at zero, so later attempts are shifted to follow the earlier ones)."""
    out: list[float | None] = []
    offset, last = 0.0, None
    for r in rows:
        t = _num(r.get("time"))
        if t is None:
            out.append(None)
            continue
        if last is not None and t + offset < last:
            offset = last
        out.append(t + offset)
        last = t + offset
    return out


def _xy(xs: list, ys: list) -> tuple[list[float], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _col(rows: list[dict], key: str) -> list[float | None]:
    return [_num(r.get(key)) for r in rows]


def _smooth(ys: list[float], window: int) -> list[float]:
    """Trailing moving average (shorter windows at the start)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _progress_axis(rows: list[dict]) -> tuple[list[float | None], str]:
    steps = _col(rows, "env_steps")
    if any(s is not None for s in steps):
        return steps, "env steps"
    return _col(rows, "iter"), "update (iter)"


# ----------------------------------------------------------------------------- plots


def _figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (8.0, 4.5)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols)
    return fig, axes


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    return path


def _plot_trend(rows, out: Path, key: str, ylabel: str, title: str, color: str, name: str,
                ylim: tuple[float, float] | None = None) -> Path:
    """One metric per update against env steps, with a moving average."""
    xs, xlabel = _progress_axis(rows)
    x, y = _xy(xs, _col(rows, key))
    if not x:
        raise _Skip(f"no {key} values in metrics.jsonl")
    window = max(3, len(y) // 10)
    fig, ax = _figure()
    ax.plot(x, y, "o-", color=color, alpha=0.35, ms=3, lw=1, label="per update")
    ax.plot(x, _smooth(y, window), color=color, lw=2.2, label=f"moving average ({window} updates)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _save(fig, out / name)


def _plot_success(rows, out: Path) -> Path:
    return _plot_trend(rows, out, "success_rate", "success rate", "Success rate vs env steps", "#4c72b0",
                       "success.png", ylim=(-0.03, 1.03))


def _plot_return(rows, out: Path) -> Path:
    return _plot_trend(rows, out, "return_mean", "mean episode return", "Mean return vs env steps", "#55a868",
                       "return.png")


def _plot_throughput(rows, out: Path) -> Path:
    t = _wall_time(rows)
    x, y = _xy(t, _col(rows, "env_steps_per_s"))
    steps = _col(rows, "env_steps")
    # per-update rate: env steps added since the previous update over the time it took
    inst_x, inst_y = [], []
    prev = None
    for ti, si in zip(t, steps):
        if ti is None or si is None:
            continue
        if prev is not None and ti > prev[0] and si >= prev[1]:
            inst_x.append(ti)
            inst_y.append((si - prev[1]) / (ti - prev[0]))
        prev = (ti, si)
    if not x and not inst_x:
        raise _Skip("no env_steps_per_s (or env_steps with time) in metrics.jsonl")
    fig, ax = _figure()
    if inst_x:
        ax.plot(inst_x, inst_y, ".-", color="#dd8452", alpha=0.5, lw=1, label="per update (Δ env steps / Δ time)")
    if x:
        ax.plot(x, y, color="#c44e52", lw=2.2, label="run average (as logged)")
    ax.set_xlabel("wall time since start (s)")
    ax.set_ylabel("env steps / s")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput vs wall time")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _save(fig, out / "throughput.png")


def _plot_staleness(rows, out: Path) -> Path:
    smax = [v for v in _col(rows, "staleness_max") if v is not None]
    smean = [v for v in _col(rows, "staleness_mean") if v is not None]
    iters, dropped = _xy(_col(rows, "iter"), _col(rows, "dropped_stale"))
    if not smax and not smean:
        raise _Skip("no staleness_max / staleness_mean in metrics.jsonl")
    fig, axes = _figure(1, 2 if dropped else 1, size=(11.0 if dropped else 8.0, 4.5))
    ax = axes[0] if dropped else axes
    top = max(smax + smean + [0.0])
    edges = [i - 0.5 for i in range(math.ceil(top) + 2)]
    data = [d for d in (smax, smean) if d]
    labels = [lab for lab, d in (("staleness_max", smax), ("staleness_mean", smean)) if d]
    colors = [c for c, d in (("#c44e52", smax), ("#4c72b0", smean)) if d]
    ax.hist(data, bins=edges, label=labels, color=colors)
    step = max(1, (len(edges) - 1) // 12)
    ax.set_xticks(range(0, len(edges) - 1, step))
    ax.set_xlabel("policy versions behind the learner (means binned to the nearest version)")
    ax.set_ylabel("updates")
    ax.set_title("Staleness of consumed data\n(histogram over updates of per-update max and mean)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    if dropped:
        ax2 = axes[1]
        ax2.step(iters, dropped, where="post", color="#937860", lw=2, label="dropped_stale")
        it_c, consumed = _xy(_col(rows, "iter"), _col(rows, "chunks_consumed"))
        if consumed:
            ax2.step(it_c, consumed, where="post", color="#55a868", lw=1.5, ls="--", label="chunks_consumed")
        ax2.set_xlabel("update (iter)")
        ax2.set_ylabel("chunks (cumulative)")
        ax2.set_title("Chunks dropped as stale over updates", fontsize=10)
        ax2.legend(fontsize=8)
        ax2.grid(alpha=0.3)
    return _save(fig, out / "staleness.png")


def _lane_order(util: dict) -> dict:
    """The four pipeline lanes in pipeline order, then any others as found."""
    from swimlane.trace import LANES

    return {ln: util[ln] for ln in [*[x for x in LANES if x in util], *[x for x in util if x not in LANES]]}


def _plot_lanes(traces, out: Path) -> Path:
    from swimlane.trace import LANES, utilization

    utils = {rank: utilization(spans) for rank, spans in traces.items() if spans}
    if not utils:
        raise _Skip("no trace*.json with spans (was swimlane.trace false?)")
    lanes = [ln for ln in LANES if any(ln in u for u in utils.values())]
    lanes += [ln for u in utils.values() for ln in u if ln not in lanes]
    lanes = list(dict.fromkeys(lanes))
    ranks = list(utils)
    width = 0.8 / len(ranks)
    fig, ax = _figure(size=(max(8.0, 1.2 * len(lanes) * max(1, len(ranks)) ** 0.5 + 3), 4.5))
    for i, rank in enumerate(ranks):
        xs = [j - 0.4 + width * (i + 0.5) for j in range(len(lanes))]
        vals = [utils[rank].get(ln, {}).get("utilization", 0.0) for ln in lanes]
        bars = ax.bar(xs, vals, width=width * 0.95, label=f"rank {rank}")
        if len(ranks) * len(lanes) <= 32:
            ax.bar_label(bars, labels=[f"{v:.0%}" if ln in utils[rank] else "" for v, ln in zip(vals, lanes)],
                         fontsize=7, padding=1)
    ax.set_xticks(range(len(lanes)))
    ax.set_xticklabels(lanes)
    ax.set_xlabel("lane")
    ax.set_ylabel("busy fraction of traced wall time")
    ax.set_ylim(0, 1.1)
    ax.set_title("Lane utilisation per rank (from trace files)")
    ax.legend(fontsize=8, ncol=min(4, len(ranks)))
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out / "lanes.png")


def _plot_gantt(traces, out: Path) -> Path:
    from swimlane.trace import draw_gantt

    spans = traces.get(0)
    if not spans:
        raise _Skip("no rank 0 trace (trace.json) with spans")
    end = max(s[3] for s in spans)
    start = max(min(s[2] for s in spans), end - GANTT_LAST_S)
    # clip to the window so long spans do not stretch the axis to the left
    clipped = [(ln, k, max(b, start), min(e, end)) for ln, k, b, e in spans if e >= start and b <= end]
    title = f"rank 0 swimlane, last {end - start:.1f} s of the trace (t = {start:.1f} to {end:.1f} s)"
    return Path(draw_gantt(clipped, out / "gantt.png", title=title, window=(start, end)))


def _plot_memory(rows, out: Path) -> Path:
    keys = list(dict.fromkeys(k for r in rows for k in r if k.startswith("mem/")))
    shown = [k for k in keys if k.endswith(("/reserved_mb", "/in_use_mb"))]
    if not shown:
        shown = [k for k in keys if k.endswith("_mb") and "/budget_mb" not in k]
    if not shown:
        raise _Skip("no mem/* metrics in metrics.jsonl (memory.enabled false or an older run)")
    iters = _col(rows, "iter")
    fig, ax = _figure()
    colors = {}
    palette = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860"]
    for k in shown:
        pool = k.split("/")[1]
        color = colors.setdefault(pool, palette[len(colors) % len(palette)])
        x, y = _xy(iters, _col(rows, k))
        if x:
            ax.plot(x, y, color=color, ls="--" if "in_use" in k else "-", lw=1.8, label=k[len("mem/"):])
    for k in keys:
        if k.endswith("/budget_mb"):
            vals = [v for v in _col(rows, k) if v is not None]
            if vals:
                ax.axhline(vals[-1], color=colors.get(k.split("/")[1], "#333333"), ls=":", lw=1,
                           label=k[len("mem/"):])
    ax.set_xlabel("update (iter)")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title("Memory pools per update (solid: reserved, dashed: in use)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out / "memory.png")


# ----------------------------------------------------------------------------- summary


def _fmt(v: Any, spec: str = ".4g") -> str:
    n = _num(v)
    return "n/a" if n is None else format(n, spec)


def _mib(nbytes: Any) -> str:
    n = _num(nbytes)
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def _summary_text(run: Path, rows: list[dict], summaries: dict[int, dict], traces: dict[int, list],
                  config: dict, pngs: list[Path], skipped: list[str], notes: list[str]) -> str:
    from swimlane.trace import utilization

    s0 = summaries.get(0, {})
    lines = [f"dvla run report: {run}"]
    mode = s0.get("mode") or (config.get("swimlane") or {}).get("mode")
    world = (s0.get("topology") or {}).get("world_size") or _num(rows[-1].get("world_size"))
    head = []
    if mode:
        head.append(f"mode {mode}")
    if world:
        head.append(f"world size {int(world)}")
    if s0:
        target = s0.get("iterations")
        state = "error" if s0.get("error") else ("stopped early" if s0.get("stopped_early") else "completed")
        if s0.get("time_limit_reached"):
            state += " (time limit reached)"
        head.append(f"{state}, version {s0.get('version', '?')}/{target if target is not None else '?'}")
    else:
        head.append("no summary.json (run still going or crashed before the end?)")
    lines.append("  " + ", ".join(head))
    if s0.get("error"):
        lines.append(f"  error: {str(s0['error']).strip().splitlines()[-1]}")

    # run length
    steps = [v for v in _col(rows, "env_steps") if v is not None]
    env_steps = s0.get("env_steps", steps[-1] if steps else None)
    t = [v for v in _wall_time(rows) if v is not None]
    wall = _num(s0.get("wall_s"))
    wall_txt = f"{wall:.2f} s (this attempt)" if wall is not None else "n/a"
    if t:
        wall_txt += f", last update at {t[-1]:.2f} s"
    lines.append(f"run length: {len(rows)} updates, {_fmt(env_steps, '.0f')} env steps, wall time {wall_txt}")

    # learning
    xs, _ = _progress_axis(rows)
    it_succ = [(r.get("iter"), x, v) for r, x, v in zip(rows, xs, _col(rows, "success_rate")) if v is not None]
    if it_succ:
        best = max(it_succ, key=lambda p: p[2])
        final = s0.get("final_success_rate", it_succ[-1][2])
        tail = [p[2] for p in it_succ[-max(min(len(it_succ), 5), len(it_succ) // 10):]]
        lines.append(f"success rate: final {_fmt(final, '.3f')}, best {best[2]:.3f} (update {best[0]}), "
                     f"mean of last {len(tail)} updates {sum(tail) / len(tail):.3f}")
    else:
        lines.append("success rate: n/a")
    rets = [v for v in _col(rows, "return_mean") if v is not None]
    if rets:
        lines.append(f"return: final {rets[-1]:.4g}, best {max(rets):.4g}")

    # throughput
    sps = _num(s0.get("env_steps_per_s"))
    logged = [v for v in _col(rows, "env_steps_per_s") if v is not None]
    if sps is None and logged:
        sps = logged[-1]
    thr = f"throughput: {_fmt(sps, '.1f')} env steps/s (run average)"
    if logged:
        thr += f", logged per update min {min(logged):.1f} / max {max(logged):.1f}"
    lines.append(thr)

    # staleness
    smax = [v for v in _col(rows, "staleness_max") if v is not None]
    smean = [v for v in _col(rows, "staleness_mean") if v is not None]
    max_st = (config.get("swimlane") or {}).get("max_staleness")
    if smax or smean:
        parts = []
        if smean:
            parts.append(f"mean of per-update mean {sum(smean) / len(smean):.2f}")
        if smax:
            parts.append(f"largest per-update max {max(smax):.0f}, "
                         f"updates with stale data {sum(v > 0 for v in smax)}/{len(smax)}")
        if max_st is not None:
            parts.append(f"limit max_staleness={max_st}")
        lines.append("staleness (versions): " + ", ".join(parts))
    else:
        lines.append("staleness: n/a (no staleness_* metrics)")
    isw = [v for v in _col(rows, "is_weight_mean") if v is not None]
    if isw:
        lines.append(f"importance weights: mean {sum(isw) / len(isw):.4f} (min {min(isw):.4f}, max {max(isw):.4f})")

    # chunks
    tot = s0.get("totals") or s0
    last = rows[-1]
    consumed = tot.get("chunks_consumed", last.get("chunks_consumed"))
    dropped = tot.get("dropped_stale", last.get("dropped_stale"))
    chunk_line = f"chunks: consumed {_fmt(consumed, '.0f')}, dropped stale {_fmt(dropped, '.0f')}"
    sent_total = sum(int(_num((s.get("totals") or s).get("chunks_sent")) or 0) for s in summaries.values())
    if summaries:
        chunk_line += f", sent (all ranks) {sent_total}"
    env_err = sum(int(_num((s.get("totals") or s).get("env_errors")) or 0) for s in summaries.values())
    if summaries:
        chunk_line += f", env errors {env_err}"
    lines.append(chunk_line)
    acc = s0.get("chunk_accounting")
    if isinstance(acc, dict) and acc:
        body = ", ".join(f"{k} {v}" for k, v in acc.items() if k != "unaccounted")
        una = acc.get("unaccounted")
        if una is None:
            flag = "unaccounted n/a"
        elif _num(una) == 0:
            flag = "unaccounted 0 (ok)"
        else:
            flag = f"UNACCOUNTED {una} != 0 -- chunks went missing or were double counted"
        lines.append(f"chunk accounting: {body}; {flag}")
    else:
        lines.append("chunk accounting: n/a (not in summary.json)")

    # lanes
    if traces:
        lines.append("lane utilisation (busy fraction of traced time, from trace files):")
        for rank, spans in traces.items():
            u = _lane_order(utilization(spans))
            role = summaries.get(rank, {}).get("role")
            cells = "  ".join(f"{ln} {v['utilization']:.1%}" for ln, v in u.items()) or "no spans"
            lines.append(f"  rank {rank}{f' ({role})' if role else ''}: {cells}")
    else:
        from_summary = {r: s.get("lane_utilization") for r, s in summaries.items() if s.get("lane_utilization")}
        if from_summary:
            lines.append("lane utilisation (no trace files; as recorded in the summaries):")
            for rank, u in from_summary.items():
                lines.append(f"  rank {rank}: " + "  ".join(f"{ln} {_fmt(v, '.1%')}" for ln, v in u.items()))
        else:
            lines.append("lane utilisation: n/a (no trace files)")

    # restarts
    if s0:
        attempts = sorted((run / "attempts").glob("attempt*.json")) if (run / "attempts").is_dir() else []
        rline = f"restarts: {s0.get('restarts', 0)}"
        if s0.get("resumed_from"):
            rline += f", resumed from {s0['resumed_from']}"
        if attempts:
            rline += f" ({len(attempts)} attempt summar{'y' if len(attempts) == 1 else 'ies'} in attempts/)"
        lines.append(rline)

    # memory
    mem_parts = []
    for rank, s in summaries.items():
        mem = s.get("memory")
        if not isinstance(mem, dict):
            continue
        for pool, st in mem.items():
            if isinstance(st, dict) and "peak_reserved_bytes" in st:
                budget = st.get("budget_bytes")
                mem_parts.append(f"rank {rank} {pool} peak reserved {_mib(st.get('peak_reserved_bytes'))}, "
                                 f"peak in use {_mib(st.get('peak_in_use_bytes'))}"
                                 + (f", budget {_mib(budget)}" if budget else ""))
    if not mem_parts:
        peaks: dict[str, float] = {}
        for r in rows:
            for k, v in r.items():
                n = _num(v)
                if k.startswith("mem/") and k.endswith("/peak_reserved_mb") and n is not None:
                    peaks[k] = max(peaks.get(k, 0.0), n)
        mem_parts = [f"{k.split('/')[1]} peak reserved {v:.2f} MiB" for k, v in peaks.items()]
    if mem_parts:
        lines.append("memory peaks:")
        lines += [f"  {p}" for p in mem_parts]
    else:
        lines.append("memory peaks: n/a")

    lines.append("plots:")
    lines += [f"  {p}" for p in pngs] or ["  (none)"]
    if skipped:
        lines.append("skipped:")
        lines += [f"  {s}" for s in skipped]
    if notes:
        lines.append("notes:")
        lines += [f"  {n}" for n in notes]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- API


def make_report(run_dir, out_dir=None) -> dict:
    """Write the plots and ``summary.txt`` for ``run_dir`` into ``out_dir`` (default
    ``run_dir/report``). Returns ``{"pngs": [Path], "summary": str, "summary_path": Path}``.
    Raises ``FileNotFoundError`` when ``run_dir`` has no ``metrics.jsonl``."""
    from dvla.metrics import read_metrics

    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run}")
    out = Path(out_dir) if out_dir is not None else run / "report"
    out.mkdir(parents=True, exist_ok=True)

    notes: list[str] = []
    try:
        rows = read_metrics(metrics)
    except ValueError:  # e.g. a last line cut short by a crash: keep the lines that parse
        rows = []
        for n, line in enumerate(metrics.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                notes.append(f"metrics.jsonl line {n}: not valid JSON, ignored")
    rows = [r for r in rows if isinstance(r, dict)]
    if not rows:
        raise FileNotFoundError(f"{metrics} has no records")
    summaries = _load_summaries(run)
    traces = _load_traces(run, notes)
    config = _load_config(run)

    plots: list[tuple[str, Callable[[], Path]]] = [
        ("success.png", lambda: _plot_success(rows, out)),
        ("return.png", lambda: _plot_return(rows, out)),
        ("throughput.png", lambda: _plot_throughput(rows, out)),
        ("staleness.png", lambda: _plot_staleness(rows, out)),
        ("lanes.png", lambda: _plot_lanes(traces, out)),
        ("gantt.png", lambda: _plot_gantt(traces, out)),
        ("memory.png", lambda: _plot_memory(rows, out)),
    ]
    pngs: list[Path] = []
    skipped: list[str] = []
    for name, draw in plots:
        try:
            pngs.append(Path(draw()))
        except _Skip as why:
            skipped.append(f"{name}: {why}")
        except Exception as exc:  # noqa: BLE001 -- one broken plot should not cost the rest of the report
            skipped.append(f"{name}: failed ({type(exc).__name__}: {exc})")

    text = _summary_text(run, rows, summaries, traces, config, pngs, skipped, notes)
    summary_path = out / "summary.txt"
    summary_path.write_text(text)
    return {"pngs": pngs, "summary": text, "summary_path": summary_path}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dvla report", description="Plots (PNG) and a text summary of a run "
                                "directory: learning curves, throughput, staleness, lane utilisation, "
                                "a Gantt chart of rank 0 and memory.")
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
    print(result["summary"], end="")
    print(f"wrote {result['summary_path']}")
    for png in result["pngs"]:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
