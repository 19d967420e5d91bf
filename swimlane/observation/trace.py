"""Lane tracing: cheap spans per lane, saved as JSON, drawn as a swimlane Gantt chart.

A span is ``(lane, kind, start, end)`` in seconds since the tracer started (its ``t0``,
saved in the trace's meta). Recording is a ``time.perf_counter`` pair and one
``list.append`` (atomic under the GIL), so lanes record from their own threads without
locks. ``utilization`` turns a trace into per-lane busy and idle time; ``draw_gantt``
renders one trace with matplotlib, ``draw_swimlanes`` several (one block of rows each).
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

LANES = ("sampling", "inference", "gradient", "broadcast")
IDLE_KINDS = ("wait", "throttle", "follow")  # span kinds that count as idle time (follow: an update sat out,
# mostly waiting in the all-reduce for the learners with samples)
COLORS = {
    "sim": "#4c72b0", "reset": "#8172b2", "wait": "#dddddd", "throttle": "#eeeeaa", "infer": "#dd8452", "value": "#c44e52",
    "learn": "#55a868", "stale_drop": "#937860", "publish": "#da8bc3", "receive": "#8c8c8c",
    "snapshot": "#ccb974", "send": "#64b5cd", "follow": "#b7dcc0",
}

_NO_SPAN = nullcontext()
log = logging.getLogger("dvla.swimlane")


class SpanWindow(list):
    """The newest spans, at most ``maxlen`` plus an eighth (the oldest eighth goes at once,
    so that appending stays cheap). A list of the spans it holds (iterating, JSON); its
    ``len()`` and slices count every span ever added, so that a reader that remembers how
    many it has seen (autotune's ``LaneClock``: ``spans[seen:]``) reads on past a trim."""

    def __init__(self, maxlen: int):
        super().__init__()
        self.maxlen, self.dropped = maxlen, 0

    def append(self, span) -> None:
        super().append(span)
        if super().__len__() > self.maxlen + self.maxlen // 8:
            cut = super().__len__() - self.maxlen
            super().__delitem__(slice(0, cut))
            self.dropped += cut

    def __len__(self) -> int:
        return self.dropped + super().__len__()

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            return super().__getitem__(slice(max(start - self.dropped, 0), max(stop - self.dropped, 0), step))
        return super().__getitem__(i - self.dropped if i >= 0 else i)

    def held(self) -> int:
        """Spans held now."""
        return super().__len__()


class Tracer:
    """Spans of a rank's lanes: the newest ``max_spans`` or so of them (about 130 bytes
    each; :class:`SpanWindow`); older ones are dropped, counted and said once in the log."""

    def __init__(self, enabled: bool = True, max_spans: int = 1_000_000):
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.spans = SpanWindow(max_spans)
        self.max_spans = max_spans

    def span(self, lane: str, kind: str) -> AbstractContextManager[None]:
        """Record the time the ``with`` block takes (nothing, and next to no cost, when the
        tracer is off: lanes open several spans per env step)."""
        return self._span(lane, kind) if self.enabled else _NO_SPAN

    @contextmanager
    def _span(self, lane: str, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, kind, start, time.perf_counter())

    def add(self, lane: str, kind: str, start: float, end: float) -> None:
        if not self.enabled:
            return
        dropped = self.spans.dropped
        self.spans.append((lane, kind, start - self.t0, end - self.t0))
        if self.spans.dropped and not dropped:  # the window was full: the oldest spans went
            log.warning("trace: more than %d spans; keeping the newest (swimlane.trace), older ones are dropped "
                        "from now on", self.max_spans)

    def save(self, path: str | os.PathLike, **meta) -> None:
        """Write ``{"meta": meta, "spans": spans}`` as JSON (atomically). ``meta`` holds
        whatever keywords are given (the runner passes ``rank``, ``mode``, ``run_start``:
        ``time.perf_counter()`` when the run started, and ``run_start_unix``: ``time.time()``
        at that moment) plus ``t0``, the ``perf_counter`` value span times count from, so
        ``span time + t0 - run_start`` is seconds since the run started."""
        path = Path(path)
        tmp = path.with_suffix(".tmp")
        if self.spans.dropped:
            meta = {**meta, "dropped_spans": self.spans.dropped}  # the trace starts later than the run
        tmp.write_text(json.dumps({"meta": {"t0": self.t0, **meta}, "spans": list(self.spans)}))
        os.replace(tmp, path)


def load_trace(path: str | os.PathLike) -> tuple[dict, list[tuple[str, str, float, float]]]:
    data = json.loads(Path(path).read_text())
    return data.get("meta", {}), [tuple(s) for s in data["spans"]]


def utilization(spans, idle_kinds=IDLE_KINDS) -> dict[str, dict[str, float]]:
    """Per lane: busy seconds (spans not of an idle kind), idle seconds and busy fraction
    over the traced wall time (first span start to last span end)."""
    if not spans:
        return {}
    t0 = min(s[2] for s in spans)
    t1 = max(s[3] for s in spans)
    wall = max(t1 - t0, 1e-9)
    out: dict[str, dict[str, float]] = {}
    for lane in dict.fromkeys([s[0] for s in spans]):
        busy = sum(e - b for ln, k, b, e in spans if ln == lane and k not in idle_kinds)
        out[lane] = {"busy_s": busy, "idle_s": wall - busy, "utilization": busy / wall}
    return out


def draw_gantt(spans, path: str | os.PathLike, title: str = "dvla swimlane",
               window: tuple[float, float] | None = None, **kwargs) -> Path:
    """Draw one row per lane, one bar per span (colour by kind); returns the PNG path.
    ``window`` (start, end) clips the chart to that interval; keyword arguments go to
    :func:`draw_swimlanes`."""
    return draw_swimlanes([("", spans)], path, title=title, window=window, **kwargs)["path"]


def draw_swimlanes(blocks, path: str | os.PathLike, title: str = "dvla swimlane",
                   window: tuple[float, float] | None = None, xlabel: str = "seconds",
                   busy_label: bool = True) -> dict:
    """Draw a Gantt chart of several traces stacked: ``blocks`` is a list of
    ``(label, spans)`` (e.g. ``("rank 1", spans)``), one block of lane rows each, with the
    times of all blocks on one axis. Spans are clipped to ``window`` (default: first span
    start to last span end); a lane gets a row only when it has spans in the window, and
    the axes fit the rows and the window exactly. Row labels read ``"rank 1 · sampling"``
    (``"sampling"`` for an unlabelled block) plus, with ``busy_label``, the lane's busy
    fraction of the window. Returns ``{"path", "rows" (the drawn row labels, top to
    bottom), "lanes" ([(block label, lane)] per row), "window", "xlim", "ylim",
    "kinds"}``; ``xlim`` and ``ylim`` are read back from the axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    everything = [s for _, spans in blocks for s in spans]
    if window is None:
        window = (min((s[2] for s in everything), default=0.0), max((s[3] for s in everything), default=1.0))
    w0, w1 = float(window[0]), float(window[1])
    if w1 <= w0:
        w1 = w0 + 1e-3
    min_w = (w1 - w0) / 1500  # a span shorter than ~1 pixel still shows
    rows: list[tuple[str, str, dict[str, list[tuple[float, float]]], float]] = []
    for label, spans in blocks:
        clipped = [(ln, k, max(b, w0), min(e, w1)) for ln, k, b, e in spans if e >= w0 and b <= w1]
        lanes = [ln for ln in LANES if any(s[0] == ln for s in clipped)]
        lanes += [ln for ln in dict.fromkeys(s[0] for s in clipped) if ln not in lanes]
        for lane in lanes:
            bars: dict[str, list[tuple[float, float]]] = {}
            busy = 0.0
            for ln, kind, b, e in clipped:
                if ln == lane:
                    bars.setdefault(kind, []).append((b, max(e - b, min_w)))
                    busy += (e - b) if kind not in IDLE_KINDS else 0.0
            rows.append((label, lane, bars, busy / (w1 - w0)))

    fig = Figure(figsize=(13, max(2.6, 1.3 + 0.36 * len(rows))))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    kinds: set[str] = set()
    labels = []
    shade = False
    for row, (label, lane, bars, busy) in enumerate(rows):
        if row and label != rows[row - 1][0]:  # a new block: a separator, alternate shading
            ax.axhline(row - 0.5, color="#555555", lw=0.8)
            shade = not shade
        if shade:
            ax.axhspan(row - 0.5, row + 0.5, color="#f2f2f2", zorder=0)
        for kind, xs in bars.items():
            kinds.add(kind)
            ax.broken_barh(xs, (row - 0.4, 0.8), facecolors=COLORS.get(kind, "#333333"), zorder=2)
        text = f"{label} · {lane}" if label else lane
        labels.append(text)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{t} ({r[3]:.0%})" if busy_label else t for t, r in zip(labels, rows)], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # top to bottom, no margin
    ax.set_xlim(w0, w1)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.25, axis="x")
    if kinds:
        ax.legend(handles=[Patch(color=COLORS.get(k, "#333333"), label=k) for k in sorted(kinds)],
                  loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, borderaxespad=0.0)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return {"path": path, "rows": [t.get_text() for t in ax.get_yticklabels()],
            "lanes": [(r[0], r[1]) for r in rows], "window": (w0, w1), "xlim": tuple(map(float, ax.get_xlim())),
            "ylim": tuple(map(float, ax.get_ylim())), "kinds": sorted(kinds)}
