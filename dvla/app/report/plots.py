"""The report's plots (one PNG each; each returns its path, or raises ``Skip`` naming the
missing data). The Gantt chart is in ``dvla.app.report.gantt``."""

from __future__ import annotations

import math
from pathlib import Path

from dvla.app.report.data import Skip, col, num, progress_axis, smooth, wall_time, xy

DPI = 110
PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860"]


def figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (8.0, 4.5)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols)
    return fig, axes


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def plot_trend(rows, out: Path, key: str, ylabel: str, title: str, color: str, name: str,
                ylim: tuple[float, float] | None = None) -> Path:
    """One metric per update against env steps, with a moving average."""
    xs, xlabel = progress_axis(rows)
    x, y = xy(xs, col(rows, key))
    if not x:
        raise Skip(f"no {key} values in metrics.jsonl")
    window = max(3, len(y) // 10)
    fig, ax = figure()
    ax.plot(x, y, "o-", color=color, alpha=0.35, ms=3, lw=1, label="per update")
    ax.plot(x, smooth(y, window), color=color, lw=2.2, label=f"moving average ({window} updates)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return save(fig, out / name)


def plot_success(rows, out: Path) -> Path:
    return plot_trend(rows, out, "success_rate", "success rate", "Success rate vs env steps", "#4c72b0",
                       "success.png", ylim=(-0.03, 1.03))


def plot_return(rows, out: Path) -> Path:
    return plot_trend(rows, out, "return_mean", "mean episode return", "Mean return vs env steps", "#55a868",
                       "return.png")


def plot_throughput(rows, out: Path) -> Path:
    t = wall_time(rows)
    x, y = xy(t, col(rows, "env_steps_per_s"))
    steps = col(rows, "env_steps")
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
        raise Skip("no env_steps_per_s (or env_steps with time) in metrics.jsonl")
    fig, ax = figure()
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
    return save(fig, out / "throughput.png")


def plot_staleness(rows, out: Path) -> Path:
    smax = [v for v in col(rows, "staleness_max") if v is not None]
    smean = [v for v in col(rows, "staleness_mean") if v is not None]
    iters, dropped = xy(col(rows, "iter"), col(rows, "dropped_stale"))
    if not smax and not smean:
        raise Skip("no staleness_max / staleness_mean in metrics.jsonl")
    fig, axes = figure(1, 2 if dropped else 1, size=(11.0 if dropped else 8.0, 4.5))
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
        it_c, consumed = xy(col(rows, "iter"), col(rows, "chunks_consumed"))
        if consumed:
            ax2.step(it_c, consumed, where="post", color="#55a868", lw=1.5, ls="--", label="chunks_consumed")
        ax2.set_xlabel("update (iter)")
        ax2.set_ylabel("chunks (cumulative)")
        ax2.set_title("Chunks dropped as stale over updates", fontsize=10)
        ax2.legend(fontsize=8)
        ax2.grid(alpha=0.3)
    return save(fig, out / "staleness.png")


def lane_order(util: dict) -> dict:
    """The four pipeline lanes in pipeline order, then any others as found."""
    from swimlane.observation.trace import LANES

    return {ln: util[ln] for ln in [*[x for x in LANES if x in util], *[x for x in util if x not in LANES]]}


def plot_lanes(traces, out: Path) -> Path:
    from swimlane.observation.trace import LANES, utilization

    utils = {rank: utilization(spans) for rank, spans in traces.items() if spans}
    if not utils:
        raise Skip("no trace*.json with spans (was swimlane.trace false?)")
    lanes = [ln for ln in LANES if any(ln in u for u in utils.values())]
    lanes += [ln for u in utils.values() for ln in u if ln not in lanes]
    lanes = list(dict.fromkeys(lanes))
    ranks = list(utils)
    width = 0.8 / len(ranks)
    fig, ax = figure(size=(max(8.0, 1.2 * len(lanes) * max(1, len(ranks)) ** 0.5 + 3), 4.5))
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
    return save(fig, out / "lanes.png")




def _memory_pools(summary: dict) -> dict[str, dict]:
    """A summary's ``memory`` pools: ``{pool: stats}`` for stats with peak counters."""
    mem = summary.get("memory")
    if not isinstance(mem, dict):
        return {}
    return {p: st for p, st in mem.items() if isinstance(st, dict) and "peak_reserved_bytes" in st}


def _memory_per_update(ax, rows: list[dict], shown: list[str], keys: list[str]) -> None:
    """Rank 0's pools per update (``mem/*`` metrics): solid reserved, dashed in use."""
    iters = col(rows, "iter")
    colors: dict[str, str] = {}
    top = 0.0
    for k in shown:
        pool = k.split("/")[1]
        color = colors.setdefault(pool, PALETTE[len(colors) % len(PALETTE)])
        x, y = xy(iters, col(rows, k))
        if x:
            ax.plot(x, y, color=color, ls="--" if "in_use" in k else "-", lw=1.8, label=k[len("mem/"):])
            top = max(top, *y)
    for k in keys:
        if k.endswith("/budget_mb"):
            vals = [v for v in col(rows, k) if v is not None]
            if not vals:
                continue
            color = colors.get(k.split("/")[1], "#333333")
            if vals[-1] <= 3 * top:  # a budget far above the curves would flatten them
                ax.axhline(vals[-1], color=color, ls=":", lw=1, label=k[len("mem/"):])
            else:
                ax.plot([], [], color=color, ls=":", lw=1, label=f"{k[len('mem/'):]} {vals[-1]:.0f} (off scale)")
    ax.set_xlabel("update (iter)")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title("Rank 0's pools per update\n(solid: reserved, dashed: in use)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _memory_per_rank(ax, pools: dict[int, dict[str, dict]]) -> None:
    """Peak reserved (solid) and peak in use (hatched) per pool, one group of bars per rank,
    from the end-of-run summaries; a bar's label gives the share of its pool's budget."""
    ranks = list(pools)
    names = list(dict.fromkeys(p for by_pool in pools.values() for p in by_pool))
    width = 0.8 / len(names)
    for j, pool in enumerate(names):
        color = PALETTE[j % len(PALETTE)]
        xs, reserved, in_use, labels = [], [], [], []
        for i, rank in enumerate(ranks):
            st = pools[rank].get(pool)
            if st is None:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            reserved.append((num(st.get("peak_reserved_bytes")) or 0.0) / 2**20)
            in_use.append((num(st.get("peak_in_use_bytes")) or 0.0) / 2**20)
            budget = num(st.get("budget_bytes"))
            share = f"\n{reserved[-1] * 2**20 / budget:.0%} of budget" if budget else ""
            labels.append(f"{reserved[-1]:.3g}{share}")
        bars = ax.bar(xs, reserved, width=width * 0.95, color=color, label=f"{pool} peak reserved")
        ax.bar(xs, in_use, width=width * 0.6, color="none", edgecolor="#222222", hatch="///", lw=0.6,
               label="peak in use" if j == 0 else None)
        if len(xs) * len(names) <= 24:
            ax.bar_label(bars, labels=labels, fontsize=7, padding=1)
    ax.set_xticks(range(len(ranks)))
    ax.set_xticklabels([f"rank {r}" for r in ranks])
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.15)
    ax.set_title("Peak per rank and pool (end-of-run summaries)\n(solid: reserved, hatched: in use)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")


def plot_memory(rows: list[dict], summaries: dict[int, dict], out: Path) -> dict:
    """``memory.png``: rank 0's pools per update (``mem/*`` metrics; only rank 0 writes
    metrics) beside every rank's peaks (``memory`` in ``summary.json`` and
    ``summary_rank{N}.json``). Returns ``{"path", "ranks" (ranks drawn), "panels"
    (titles), "rank_labels" (the per-rank panel's tick labels)}``."""
    keys = list(dict.fromkeys(k for r in rows for k in r if k.startswith("mem/")))
    shown = [k for k in keys if k.endswith(("/reserved_mb", "/in_use_mb"))]
    if not shown:
        shown = [k for k in keys if k.endswith("_mb") and "/budget_mb" not in k]
    pools = {rank: p for rank, s in summaries.items() if (p := _memory_pools(s))}
    if not shown and not pools:
        raise Skip("no mem/* metrics in metrics.jsonl and no memory in the summaries "
                   "(memory.enabled false or an older run)")
    n = bool(shown) + bool(pools)
    fig, axes = figure(1, n, size=(13.0 if n == 2 else 8.0, 4.8))
    axes = list(axes) if n == 2 else [axes]
    info: dict = {"ranks": [0] if shown else [], "panels": [], "rank_labels": []}
    if shown:
        _memory_per_update(axes[0], rows, shown, keys)
    if pools:
        _memory_per_rank(axes[-1], pools)
        info["rank_labels"] = [t.get_text() for t in axes[-1].get_xticklabels()]
        info["ranks"] = sorted(set(info["ranks"]) | set(pools))
    info["panels"] = [ax.get_title() for ax in axes]
    info["path"] = save(fig, out / "memory.png")
    return info


def plot_autotune(rows, out: Path) -> Path:
    """swimlane.adaptation.autotune's knobs per update over wall time (one step line each), with the
    throughput per update behind them: what the resource manager chose, and when."""
    t = wall_time(rows)
    knobs = sorted({k for r in rows for k in r if k.startswith("autotune_") and k != "autotune_decisions"})
    if not knobs:
        raise Skip("no autotune_* values in metrics.jsonl")
    fig, axes = figure(len(knobs) + 1, 1, size=(8.0, 2.2 * (len(knobs) + 1)))
    colors = ["#4c72b0", "#c44e52", "#8172b2", "#937860"]
    for ax, key, color in zip(axes, knobs, colors * len(knobs)):
        x, y = xy(t, col(rows, key))
        ax.step(x, y, where="post", color=color, lw=2)
        ax.set_ylabel(key.removeprefix("autotune_"))
        ax.grid(alpha=0.3)
    x, y = xy(t, col(rows, "env_steps"))
    rate = [(b - a) / (tb - ta) for (ta, a), (tb, b) in zip(zip(x, y), zip(x[1:], y[1:])) if tb > ta]
    axes[-1].plot([tb for ta, tb in zip(x, x[1:]) if tb > ta], rate, ".-", color="#dd8452", lw=1)
    axes[-1].set_ylabel("env steps / s")
    axes[-1].set_xlabel("wall time since start (s)")
    axes[-1].grid(alpha=0.3)
    decisions = [v for v in col(rows, "autotune_decisions") if v is not None]
    axes[0].set_title(f"Resource manager: knob values per update ({int(decisions[-1]) if decisions else 0} "
                      f"decisions)")
    return save(fig, out / "autotune.png")


def plot_balance(rows, out: Path) -> Path:
    """The rollout ranks over wall time (:mod:`swimlane.adaptation.balance`): each one's speed (env steps
    per second of sampling per env group), and with ``swimlane.rebalance`` the env groups that
    step on it and its share of its learner's chunks, as the plans set them."""
    t = wall_time(rows)
    ranks = sorted({int(k.split("rank")[1]) for r in rows for k in r if k.startswith("speed/rank")})
    if len(ranks) < 2:
        raise Skip("fewer than two rollout ranks measured (speed/rank* in metrics.jsonl)")
    panels = [("speed/rank", "env steps / s\nper env group")]
    if any(k.startswith("groups/rank") for r in rows for k in r):
        panels += [("groups/rank", "env groups"), ("share/rank", "share of chunks")]
    fig, axes = figure(len(panels), 1, size=(8.0, 2.4 * len(panels)))
    axes = list(axes) if len(panels) > 1 else [axes]
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860"]
    for ax, (prefix, label) in zip(axes, panels):
        for i, rank in enumerate(ranks):
            x, y = xy(t, col(rows, f"{prefix}{rank}"))
            if x:
                ax.step(x, y, where="post", color=colors[i % len(colors)], lw=2, label=f"rank {rank}")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="best", fontsize=8)
    axes[-1].set_xlabel("wall time since start (s)")
    worst = max((v for v in col(rows, "stragglers") if v is not None), default=0)
    axes[0].set_title(f"Rollout ranks (at most {int(worst)} straggler(s) at once)")
    return save(fig, out / "balance.png")


def plot_roles(rows, out: Path) -> Path:
    """Adaptive roles over wall time (:mod:`swimlane.adaptation.roles`): which ranks learn, the env
    groups that step on each rank (0 on a rank that moved to the learners), and the learners'
    share of time waiting for chunks that the planner decides on."""
    t = wall_time(rows)
    ranks = sorted({int(k.split("rank")[1]) for r in rows for k in r if k.startswith(("role/rank", "groups/rank"))})
    if not any("role_switches" in r for r in rows):
        raise Skip("no role_switches in metrics.jsonl (swimlane.roles=fixed)")
    fig, axes = figure(3, 1, size=(8.0, 6.6))
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860"]
    x, y = xy(t, col(rows, "learners"))
    axes[0].step(x, y, where="post", color="#333333", lw=2, label="learners")
    for i, rank in enumerate(ranks):
        color = colors[i % len(colors)]
        x, y = xy(t, col(rows, f"role/rank{rank}"))
        if x:
            axes[0].step(x, [v + 0.04 * i for v in y], where="post", color=color, lw=1.5, ls="--",
                         label=f"rank {rank} learns")
        x, y = xy(t, col(rows, f"groups/rank{rank}"))
        if x:
            axes[1].step(x, [v + 0.04 * i for v in y], where="post", color=color, lw=2, label=f"rank {rank}")
    axes[0].set_ylabel("learner ranks")
    axes[1].set_ylabel("env groups")
    x, y = xy(t, col(rows, "learner_wait_share"))
    axes[2].plot(x, y, ".-", color="#8172b2", lw=1)
    axes[2].set_ylabel("learners' share of\ntime waiting for chunks")
    axes[2].set_xlabel("wall time since start (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8) if ax.get_legend_handles_labels()[0] else None
    switches = max((v for v in col(rows, "role_switches") if v is not None), default=0)
    axes[0].set_title(f"Roles per rank ({int(switches)} switch(es) between rollout and learning)")
    return save(fig, out / "roles.png")
