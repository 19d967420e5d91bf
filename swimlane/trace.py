"""Lane tracing: cheap spans per lane, saved as JSON, drawn as a swimlane Gantt chart.

A span is ``(lane, kind, start, end)`` in seconds since the tracer started. Recording
is a ``time.perf_counter`` pair and one ``list.append`` (atomic under the GIL), so
lanes record from their own threads without locks. ``utilization`` turns a trace into
per-lane busy and idle time; ``draw_gantt`` renders it with matplotlib.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LANES = ("sampling", "inference", "gradient", "broadcast")
COLORS = {
    "sim": "#4c72b0", "reset": "#8172b2", "wait": "#dddddd", "throttle": "#eeeeaa", "infer": "#dd8452", "value": "#c44e52",
    "learn": "#55a868", "stale_drop": "#937860", "publish": "#da8bc3", "receive": "#8c8c8c",
    "snapshot": "#ccb974", "send": "#64b5cd",
}


class Tracer:
    def __init__(self, enabled: bool = True, max_spans: int = 1_000_000):
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.spans: list[tuple[str, str, float, float]] = []
        self.max_spans = max_spans

    @contextmanager
    def span(self, lane: str, kind: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, kind, start, time.perf_counter())

    def add(self, lane: str, kind: str, start: float, end: float) -> None:
        if self.enabled and len(self.spans) < self.max_spans:
            self.spans.append((lane, kind, start - self.t0, end - self.t0))

    def save(self, path: str | os.PathLike, **meta) -> None:
        path = Path(path)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": meta, "spans": self.spans}))
        os.replace(tmp, path)


def load_trace(path: str | os.PathLike) -> tuple[dict, list[tuple[str, str, float, float]]]:
    data = json.loads(Path(path).read_text())
    return data.get("meta", {}), [tuple(s) for s in data["spans"]]


def utilization(spans, idle_kinds=("wait", "throttle")) -> dict[str, dict[str, float]]:
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
               window: tuple[float, float] | None = None) -> Path:
    """Draw one row per lane, one bar per span (colour by kind); returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if window is not None:
        spans = [s for s in spans if s[3] >= window[0] and s[2] <= window[1]]
    lanes = [ln for ln in LANES if any(s[0] == ln for s in spans)]
    lanes += [ln for ln in dict.fromkeys(s[0] for s in spans) if ln not in lanes]
    util = utilization(spans)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.7 * max(1, len(lanes))))
    kinds = set()
    for row, lane in enumerate(lanes):
        bars: dict[str, list[tuple[float, float]]] = {}
        for ln, kind, b, e in spans:
            if ln == lane:
                bars.setdefault(kind, []).append((b, max(e - b, 1e-5)))
        for kind, xs in bars.items():
            kinds.add(kind)
            ax.broken_barh(xs, (row - 0.4, 0.8), facecolors=COLORS.get(kind, "#333333"))
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"{ln} ({util[ln]['utilization']:.0%})" for ln in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=COLORS.get(k, "#333333"), label=k) for k in sorted(kinds)],
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(lanes) > 2 else -0.4),
              ncol=min(8, len(kinds)), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
