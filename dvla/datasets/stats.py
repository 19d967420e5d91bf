"""Dataset statistics as LeRobot keeps them in ``meta/stats.json``: per feature ``mean``,
``std``, ``min``, ``max``, ``count`` and the quantiles ``q01 q10 q50 q90 q99`` (vectors: one
value per dimension; images: per channel, scaled to [0, 1], shaped ``(3, 1, 1)``).

``dvla sft`` stores :func:`dvla_stats` (``action`` and ``proprio``) with its checkpoint to
normalise with."""

from __future__ import annotations

import numpy as np

QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
STAT_KEYS = ("mean", "std", "min", "max")


def vector_stats(x: np.ndarray) -> dict[str, np.ndarray]:
    """Stats of ``(N, D)`` values, per dimension."""
    x = np.asarray(x, dtype=np.float64)
    out = {"mean": x.mean(0), "std": x.std(0), "min": x.min(0), "max": x.max(0), "count": np.array([len(x)])}
    for q, v in zip(QUANTILES, np.quantile(x, QUANTILES, axis=0)):
        out[f"q{round(q * 100):02d}"] = v
    return out


class ImageStats:
    """Per-channel stats of ``(T, H, W, 3)`` uint8 frames, accumulated episode by episode."""

    def __init__(self):
        self.n, self.s, self.s2 = 0, np.zeros(3), np.zeros(3)
        self.lo, self.hi = np.full(3, 255.0), np.zeros(3)
        self.frames = 0
        self.hist = np.zeros((3, 256))

    def update(self, frames: np.ndarray) -> None:
        x = frames.reshape(-1, 3).astype(np.float64)
        self.n += len(x)
        self.frames += len(frames)
        self.s += x.sum(0)
        self.s2 += (x * x).sum(0)
        self.lo, self.hi = np.minimum(self.lo, x.min(0)), np.maximum(self.hi, x.max(0))
        for c in range(3):
            self.hist[c] += np.bincount(frames[..., c].ravel(), minlength=256)

    def result(self) -> dict[str, np.ndarray]:
        mean = self.s / self.n
        std = np.sqrt(np.maximum(self.s2 / self.n - mean * mean, 0.0))
        shape = (3, 1, 1)
        out = {"mean": mean / 255, "std": std / 255, "min": self.lo / 255, "max": self.hi / 255}
        out = {k: v.reshape(shape) for k, v in out.items()}
        out["count"] = np.array([self.frames])
        cdf = self.hist.cumsum(1) / self.hist.sum(1, keepdims=True)
        for q in QUANTILES:
            out[f"q{round(q * 100):02d}"] = (np.argmax(cdf >= q, axis=1) / 255).reshape(shape)
        return out


def to_json(stats: dict[str, dict[str, np.ndarray]]) -> dict:
    return {f: {k: np.asarray(v).tolist() for k, v in s.items()} for f, s in stats.items()}


def from_json(data: dict) -> dict[str, dict[str, np.ndarray]]:
    return {f: {k: np.asarray(v, dtype=np.float64) for k, v in s.items()} for f, s in data.items()}


def dvla_stats(actions: np.ndarray, proprio: np.ndarray) -> dict[str, dict[str, np.ndarray]]:
    """``{"action": ..., "proprio": ...}``: what sft normalises with."""
    return {"action": vector_stats(actions), "proprio": vector_stats(proprio)}
