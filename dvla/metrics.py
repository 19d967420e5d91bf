"""Metrics: one JSON object per line in ``metrics.jsonl``, console progress (a tqdm bar
whose postfix shows steps/s, success, return, loss, KL, weights version, staleness and
the learner's queue depth), and TensorBoard event files in ``tb/`` when the
``tensorboard`` package is installed.

Every record carries ``iter``, ``time`` (seconds since the start of the run) and
floats only, so the file loads directly with pandas (``pd.read_json(path, lines=True)``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("dvla.metrics")


class MetricsLogger:
    def __init__(self, out_dir: str | os.PathLike, total: int, enabled: bool = True,
                 progress: bool = True, filename: str = "metrics.jsonl", initial: int = 0,
                 tensorboard: bool = False):
        self.enabled = enabled
        self.start = time.perf_counter()
        self.path = Path(out_dir) / filename
        self._fh = None
        self._bar = None
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A fresh run starts a fresh file; a resumed one (``initial`` > 0) appends to the
        # rows it resumes from.
        self._fh = open(self.path, "a" if initial else "w", buffering=1)
        if tensorboard:
            self._tb = _tensorboard_writer(Path(out_dir) / "tb")
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="dvla", unit="it", dynamic_ncols=True,
                             file=sys.stderr)

    def log(self, it: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record = {"iter": it, "time": round(time.perf_counter() - self.start, 4)}
        for k, v in metrics.items():
            v = float(v)
            record[k] = v if math.isfinite(v) else None
        if not self.enabled:
            return record
        self._fh.write(json.dumps(record) + "\n")
        if self._tb is not None:
            self._tb.put(record, int(record.get("version") or it + 1))
        summary = _short(record)
        if self._bar is not None:
            self._bar.set_postfix_str(summary, refresh=False)
            self._bar.update(1)
        else:
            print(f"[dvla] iter {it}: {summary}", flush=True)
        return record

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        if self._fh is not None:
            self._fh.close()


def _tensorboard_writer(log_dir: Path) -> _TensorBoard | None:
    """A TensorBoard writer, or None when the ``tensorboard`` package is not installed
    (``pip install 'dvla[tb]'``)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return _TensorBoard(SummaryWriter(log_dir=str(log_dir)))


class _TensorBoard:
    """Writes records as TensorBoard scalars from a thread of its own: encoding some fifty
    scalars an update is CPU work (about 1.5 ms) the learner need not wait for. A failed
    write is reported once; the JSON lines go on."""

    def __init__(self, writer):
        self.writer = writer
        self.records: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._write, name="dvla-tensorboard", daemon=True)
        self.thread.start()

    def put(self, record: dict[str, Any], step: int) -> None:
        self.records.put((record, step))

    def _write(self) -> None:
        failed = False
        while (item := self.records.get()) is not None:
            record, step = item
            try:
                for k, v in record.items():
                    if v is not None and k not in ("iter", "version") and not failed:
                        self.writer.add_scalar(k, v, global_step=step)
            except Exception as exc:  # e.g. a full disk: the metrics.jsonl rows still carry everything
                failed = True
                print(f"[dvla] TensorBoard writes stopped: {exc!r}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Write what is queued, then close the event files."""
        self.records.put(None)
        self.thread.join()
        self.writer.close()


def _short(r: dict[str, Any]) -> str:
    keys = [("env_steps_per_s", "steps/s", "{:.0f}"), ("success_rate", "success", "{:.2f}"),
            ("return_mean", "return", "{:.3f}"), ("loss", "loss", "{:.4f}"), ("approx_kl", "kl", "{:.4f}"),
            ("version", "v", "{:.0f}"), ("staleness_mean", "stale", "{:.2f}"), ("queue_depth", "queue", "{:.0f}")]
    return " ".join(f"{name}={fmt.format(r[k])}" for k, name, fmt in keys if r.get(k) is not None)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _row_iter(line: str) -> int | None:
    """A metrics row's ``iter``; None for a torn or unreadable line (power loss, full disk)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return int(row.get("iter", 0)) if isinstance(row, dict) else None


TORN_LINE = "{path}: line {line} is torn or not JSON (a crash mid-write?): dropped"  # the resume's warning


def truncate_metrics(path: Path, version: int) -> None:
    """Drop the rows a stopped attempt logged at or after ``version``, the update (or SFT step)
    its resume starts from, and any torn line (the last one of a crash mid-write) with a
    warning. RL runs and ``dvla sft`` both truncate so at a resume."""
    if not path.exists():
        return
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    keep = []
    for n, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        it = _row_iter(ln)
        if it is None:
            log.warning(TORN_LINE.format(path=path, line=n))
        elif it < version:
            keep.append(ln if ln.endswith("\n") else ln + "\n")
    if "".join(keep) != "".join(lines):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)

