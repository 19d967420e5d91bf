"""The report's Gantt chart: every rank's trace on one time axis, in seconds since the run
started, over the last few learner updates.

Span times count from each tracer's ``t0`` (a ``time.perf_counter`` value, in the trace's
meta); the runner also saves ``run_start`` (``perf_counter`` when the run started) and
``run_start_unix`` (``time.time()`` at that moment). ``span + t0 - run_start`` is then
seconds since that rank's run start -- the base of ``wall_s`` in ``summary.json`` -- and
rank r is shifted by its ``run_start_unix`` minus rank 0's to line up with rank 0. A
trace without ``run_start`` (an older run) starts at its earliest span.
"""

from __future__ import annotations

from pathlib import Path

from dvla.app.report.data import Skip, Span, num

GANTT_UPDATES = 5  # learner updates the chart shows (the whole run when it has few more)
GANTT_FALLBACK_S = 10.0  # without learn spans: the last this many seconds


def align_traces(traces: dict[int, tuple[dict, list[Span]]], notes: list[str] | None = None
                 ) -> dict[int, list[Span]]:
    """``{rank: spans}`` with every time in seconds since rank 0's run start (see the
    module docstring); a fallback is noted in ``notes``."""
    notes = notes if notes is not None else []
    unix = {r: num(meta.get("run_start_unix")) for r, (meta, _) in traces.items()}
    base_rank = 0 if unix.get(0) is not None else next((r for r, u in unix.items() if u is not None), None)
    base_unix = unix[base_rank] if base_rank is not None else None
    out: dict[int, list[Span]] = {}
    for rank, (meta, spans) in traces.items():
        if not spans:
            continue
        name = meta.get("file", f"rank {rank}'s trace")
        run_start = num(meta.get("run_start"))
        if run_start is not None:
            shift = (num(meta.get("t0")) or 0.0) - run_start
        else:
            shift = -min(s[2] for s in spans)
            notes.append(f"{name}: no run_start in its meta (an older trace); the Gantt chart counts its "
                         "time from its earliest span")
        if base_unix is not None and unix[rank] is not None:
            shift += unix[rank] - base_unix
        elif len(traces) > 1 and run_start is not None:
            notes.append(f"{name}: no run_start_unix in its meta; not aligned with the other ranks in the Gantt chart")
        out[rank] = [(ln, k, b + shift, e + shift) for ln, k, b, e in spans]
    return out


def learn_spans(aligned: dict[int, list[Span]]) -> list[Span]:
    """The gradient lane's ``learn`` spans of the lowest rank that has any, by start time."""
    for spans in aligned.values():
        learns = sorted((s for s in spans if s[0] == "gradient" and s[1] == "learn"), key=lambda s: s[2])
        if learns:
            return learns
    return []


def gantt_window(aligned: dict[int, list[Span]], updates: int = GANTT_UPDATES) -> tuple[float, float, str]:
    """``(start, end, what)``: the last ``updates`` learner updates (from the end of the
    learn span before them to a little after the last one), or the whole run when it has
    at most ``updates + 1``; without learn spans, the last ``GANTT_FALLBACK_S`` seconds."""
    every = [s for spans in aligned.values() for s in spans]
    first, last = min(s[2] for s in every), max(s[3] for s in every)
    learns = learn_spans(aligned)
    if learns and len(learns) <= updates + 1:
        return first, last, f"the whole run ({len(learns)} updates)"
    if learns:
        start, end = learns[-updates - 1][3], learns[-1][3]
        end = min(last, end + 0.1 * (end - start))  # what the last update set off (its publish)
        return start, max(end, learns[-1][3]), f"the last {updates} updates"
    if last - first <= GANTT_FALLBACK_S:
        return first, last, "the whole run (no learn spans)"
    return last - GANTT_FALLBACK_S, last, f"the last {GANTT_FALLBACK_S:.0f} s (no learn spans)"


def plot_gantt(traces: dict[int, tuple[dict, list[Span]]], out: Path, notes: list[str] | None = None) -> dict:
    """``gantt.png``: one block of lane rows per rank over :func:`gantt_window`. Returns
    :func:`swimlane.observation.trace.draw_swimlanes`'s dict plus ``ranks`` (those drawn)."""
    from swimlane.observation.trace import draw_swimlanes

    aligned = align_traces(traces, notes)
    if not aligned:
        raise Skip("no trace file (trace.json, trace_rankN.json) with spans (was swimlane.trace false?)")
    start, end, what = gantt_window(aligned)
    ranks = list(aligned)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    title = f"Swimlanes of {who}: {what}, t = {start:.1f} to {end:.1f} s since the run started"
    info = draw_swimlanes([(f"rank {r}", aligned[r]) for r in ranks], out / "gantt.png", title=title,
                          window=(start, end), xlabel="seconds since the run started")
    info["ranks"] = sorted({int(label.split()[1]) for label, _ in info["lanes"]})
    return info
