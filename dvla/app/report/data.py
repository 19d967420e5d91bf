"""What ``dvla report`` reads from a run directory, and the small series helpers its plots
and summary share: metrics rows as columns, wall time continuous across restarts, the
per-rank summaries, traces (with their meta) and the config."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

Span = tuple[str, str, float, float]


class Skip(Exception):
    """A plot has no data to draw; the message says what is missing."""


def num(v: Any) -> float | None:
    """A finite float, or None for null / missing / non-numeric / non-finite values."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def rank_of(path: Path, meta: dict | None = None) -> int:
    if meta and isinstance(meta.get("rank"), int):
        return meta["rank"]
    m = re.search(r"_rank(\d+)\.json$", path.name)
    return int(m.group(1)) if m else 0


def load_metrics(path: Path, notes: list[str]) -> list[dict]:
    """The records of ``metrics.jsonl``; a line that does not parse (e.g. the last one,
    cut short by a crash) is skipped with a note."""
    from dvla.metrics import read_metrics

    try:
        rows = read_metrics(path)
    except ValueError:
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                notes.append(f"metrics.jsonl line {n}: not valid JSON, ignored")
    return [r for r in rows if isinstance(r, dict)]


def load_summaries(run: Path) -> dict[int, dict]:
    """``{rank: summary}`` from ``summary.json`` (rank 0) and ``summary_rank{N}.json``."""
    out: dict[int, dict] = {}
    files = ([run / "summary.json"] if (run / "summary.json").exists() else []) + sorted(run.glob("summary_rank*.json"))
    for f in files:
        data = read_json(f)
        if data is not None:
            out.setdefault(rank_of(f, data), data)
    return dict(sorted(out.items()))


def load_traces(run: Path, notes: list[str]) -> dict[int, tuple[dict, list[Span]]]:
    """``{rank: (meta, spans)}`` from ``trace.json`` and ``trace_rank{N}.json``."""
    from swimlane.observation.trace import load_trace

    out: dict[int, tuple[dict, list[Span]]] = {}
    for f in sorted(run.glob("trace*.json")):
        try:
            meta, spans = load_trace(f)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            notes.append(f"{f.name}: unreadable trace ({type(exc).__name__}: {exc}), ignored")
            continue
        meta = meta if isinstance(meta, dict) else {}
        out.setdefault(rank_of(f, meta), ({**meta, "file": f.name}, spans))
    return dict(sorted(out.items()))


def load_config(run: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load((run / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):  # optional context only
        return {}
    return data if isinstance(data, dict) else {}


def wall_time(rows: list[dict]) -> list[float | None]:
    """Seconds since the run started, continuous across restarts (each attempt's logger
    restarts ``time`` at zero, so later attempts are shifted to follow the earlier ones)."""
    out: list[float | None] = []
    offset, last = 0.0, None
    for r in rows:
        t = num(r.get("time"))
        if t is None:
            out.append(None)
            continue
        if last is not None and t + offset < last:
            offset = last
        out.append(t + offset)
        last = t + offset
    return out


def xy(xs: list, ys: list) -> tuple[list[float], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def col(rows: list[dict], key: str) -> list[float | None]:
    return [num(r.get(key)) for r in rows]


def smooth(ys: list[float], window: int) -> list[float]:
    """Trailing moving average (shorter windows at the start)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def progress_axis(rows: list[dict]) -> tuple[list[float | None], str]:
    steps = col(rows, "env_steps")
    if any(s is not None for s in steps):
        return steps, "env steps"
    return col(rows, "iter"), "update (iter)"
