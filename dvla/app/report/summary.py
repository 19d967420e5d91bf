"""The text summary of ``dvla report`` (``summary.txt``, also printed): run state, length,
learning, throughput, staleness, chunk accounting, lane utilisation, restarts, memory
and the list of plots written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dvla.app.report.data import col, num, progress_axis, wall_time
from dvla.app.report.plots import lane_order


def _fmt(v: Any, spec: str = ".4g") -> str:
    n = num(v)
    return "n/a" if n is None else format(n, spec)


def _mib(nbytes: Any) -> str:
    n = num(nbytes)
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def summary_text(run: Path, rows: list[dict], summaries: dict[int, dict], traces: dict[int, list],
                  config: dict, pngs: list[Path], skipped: list[str], notes: list[str]) -> str:
    from swimlane.observation.trace import utilization

    s0 = summaries.get(0, {})
    lines = [f"dvla run report: {run}"]
    mode = s0.get("mode") or (config.get("swimlane") or {}).get("mode")
    world = (s0.get("topology") or {}).get("world_size") or num(rows[-1].get("world_size"))
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
    steps = [v for v in col(rows, "env_steps") if v is not None]
    env_steps = s0.get("env_steps", steps[-1] if steps else None)
    t = [v for v in wall_time(rows) if v is not None]
    wall = num(s0.get("wall_s"))
    wall_txt = f"{wall:.2f} s (this attempt)" if wall is not None else "n/a"
    if t:
        wall_txt += f", last update at {t[-1]:.2f} s"
    lines.append(f"run length: {len(rows)} updates, {_fmt(env_steps, '.0f')} env steps, wall time {wall_txt}")

    # learning
    xs, _ = progress_axis(rows)
    it_succ = [(r.get("iter"), x, v) for r, x, v in zip(rows, xs, col(rows, "success_rate")) if v is not None]
    if it_succ:
        best = max(it_succ, key=lambda p: p[2])
        final = s0.get("final_success_rate", it_succ[-1][2])
        tail = [p[2] for p in it_succ[-max(min(len(it_succ), 5), len(it_succ) // 10):]]
        lines.append(f"success rate: final {_fmt(final, '.3f')}, best {best[2]:.3f} (update {best[0]}), "
                     f"mean of last {len(tail)} updates {sum(tail) / len(tail):.3f}")
    else:
        lines.append("success rate: n/a")
    rets = [v for v in col(rows, "return_mean") if v is not None]
    if rets:
        lines.append(f"return: final {rets[-1]:.4g}, best {max(rets):.4g}")

    # throughput
    sps = num(s0.get("env_steps_per_s"))
    logged = [v for v in col(rows, "env_steps_per_s") if v is not None]
    if sps is None and logged:
        sps = logged[-1]
    thr = f"throughput: {_fmt(sps, '.1f')} env steps/s (run average)"
    if logged:
        thr += f", logged per update min {min(logged):.1f} / max {max(logged):.1f}"
    lines.append(thr)

    # staleness
    smax = [v for v in col(rows, "staleness_max") if v is not None]
    smean = [v for v in col(rows, "staleness_mean") if v is not None]
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
    isw = [v for v in col(rows, "is_weight_mean") if v is not None]
    if isw:
        lines.append(f"importance weights: mean {sum(isw) / len(isw):.4f} (min {min(isw):.4f}, max {max(isw):.4f})")

    # chunks
    tot = s0.get("totals") or s0
    last = rows[-1]
    consumed = tot.get("chunks_consumed", last.get("chunks_consumed"))
    dropped = tot.get("dropped_stale", last.get("dropped_stale"))
    chunk_line = f"chunks: consumed {_fmt(consumed, '.0f')}, dropped stale {_fmt(dropped, '.0f')}"
    sent_total = sum(int(num((s.get("totals") or s).get("chunks_sent")) or 0) for s in summaries.values())
    if summaries:
        chunk_line += f", sent (all ranks) {sent_total}"
    env_err = sum(int(num((s.get("totals") or s).get("env_errors")) or 0) for s in summaries.values())
    if summaries:
        chunk_line += f", env errors {env_err}"
    lines.append(chunk_line)
    acc = s0.get("chunk_accounting")
    if isinstance(acc, dict) and acc:
        body = ", ".join(f"{k} {v}" for k, v in acc.items() if k != "unaccounted")
        una = acc.get("unaccounted")
        if una is None:
            flag = "unaccounted n/a"
        elif num(una) == 0:
            flag = "unaccounted 0 (ok)"
        else:
            flag = f"UNACCOUNTED {una} != 0 -- chunks went missing or were double counted"
        lines.append(f"chunk accounting: {body}; {flag}")
    else:
        lines.append("chunk accounting: n/a (not in summary.json)")

    # rollout ranks (swimlane/adaptation/balance.py)
    bal = s0.get("balance") or {}
    if len(bal.get("by_rank") or {}) > 1:
        speeds = ", ".join(f"rank {r} {_fmt(num(d.get('steps', 0)) / num(d['sample_s']), '.0f')}"
                           for r, d in bal["by_rank"].items() if num(d.get("sample_s")))
        lines.append(f"rollout ranks (last {_fmt(bal.get('window_s'), 'g')} s): env steps/s per env group: {speeds}; "
                     f"stragglers at the end: {bal.get('stragglers') or 'none'}")
    moves = bal.get("moves") or []  # (whichever ranks the last window saw deliver)
    if moves:
        lines.append(f"rebalancing: {len(moves)} env group move(s): "
                     + ", ".join(f"v{m['version']} rank {m['src']} -> {m['dst']}" for m in moves[:8])
                     + (" ..." if len(moves) > 8 else ""))
    roles = bal.get("roles")
    if roles:
        switches = roles.get("switches") or []
        lines.append(f"roles: {len(switches)} switch(es)"
                     + "".join(f", v{w['version']} rank {w['rank']} -> {w['to']}" for w in switches[:8])
                     + (" ..." if len(switches) > 8 else "") + f"; learner ranks at the end: {roles.get('learners')}")

    # lanes
    if traces:
        lines.append("lane utilisation (busy fraction of traced time, from trace files):")
        for rank, spans in traces.items():
            u = lane_order(utilization(spans))
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
                n = num(v)
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


