"""The resource manager's knobs on a rank (``swimlane.autotune``): what each one reads
and sets on the rank's lanes and threads (:mod:`swimlane.adaptation.autotune` decides the moves)."""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from dvla.config import SwimlaneConfig
from swimlane.adaptation.autotune import Knob, Setting, Tuner

log = logging.getLogger("dvla.swimlane")


class CpuSplit:
    """An autotune knob: the gradient lane's thread on one half of the rank's CPUs and the
    rollout lanes' threads on the other (off: every thread may run on all of them)."""

    ROLLOUT = ("sampling", "inference")

    def __init__(self, cpus: list[int], tids: Callable[[], dict[str, int]]):
        self.cpus, self.tids, self.on = cpus, tids, False

    def set(self, on: int) -> None:
        half = len(self.cpus) // 2
        for lane, tid in self.tids().items():
            if not on:
                cpus = self.cpus
            else:
                cpus = self.cpus[half:] if lane == "gradient" else self.cpus[:half] if lane in self.ROLLOUT else None
            if cpus is not None:
                os.sched_setaffinity(tid, cpus)
        self.on = bool(on)


def tuner_for(sl: SwimlaneConfig, lane, inference, tids: Callable[[], dict[str, int]], ledger,
              tracer, turns) -> Tuner | None:
    """The resource manager of an async rank (``swimlane.autotune``), or None. Its knobs:
    the env groups that step (``lane.active``), how long a forward pass waits for more
    groups' requests (``inference.wait_s``, in ms), whether the lanes take turns (``turns``,
    the rank's :class:`swimlane.lanes.turns.Turns`: ``swimlane.take_turns``), the gradient
    lane's niceness, torch's intra-op threads and whether the gradient lane's thread and the rollout lanes' threads run on separate halves
    of the rank's CPUs (``split_cpus``), and on a GPU with ``swimlane.cuda_streams``
    whether the inference stream runs at the highest priority (``inference_priority``).
    ``tids()``: the lanes' native thread ids by lane name, of those running."""
    if not sl.autotune:
        return None

    def set_groups(v: int) -> None:
        lane.active = v

    def gradient_tid() -> int | None:
        return tids().get("gradient")

    def get_nice() -> int:
        tid = gradient_tid()
        return sl.gradient_nice if tid is None else os.getpriority(os.PRIO_PROCESS, tid)

    def set_nice(v: int) -> None:
        tid = gradient_tid()
        if tid is None:
            raise OSError("the gradient lane runs on another rank or has not started")
        os.setpriority(os.PRIO_PROCESS, tid, v)

    def set_wait(ms: int) -> None:
        inference.wait_s = ms / 1000.0

    def overlapping(v: dict[str, int]) -> bool:  # while the lanes take turns they never compete
        return not v["take_turns"]

    settings = [Setting(Knob("env_groups", 1, sl.env_groups), lambda: lane.active, set_groups),
                Setting(Knob("take_turns", 0, 1), lambda: int(turns.on), lambda v: turns.set(bool(v)))]
    if sl.env_groups > 1:  # a wait for more groups' requests, which only lanes that overlap make
        settings.append(Setting(Knob("inference_wait_ms", 0, 8, step=2), lambda: round(inference.wait_s * 1000),
                                set_wait, needs=lambda v: overlapping(v) and v["env_groups"] > 1))
    if gradient_tid() is not None or sl.gradient_nice:
        settings.append(Setting(Knob("gradient_nice", 0, 15, step=5), get_nice, set_nice, needs=overlapping))
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) > 1:
        settings.append(Setting(Knob("torch_threads", 1, len(cpus)), torch.get_num_threads, torch.set_num_threads))
        if gradient_tid() is not None:
            split = CpuSplit(cpus, tids)
            settings.append(Setting(Knob("split_cpus", 0, 1), lambda: int(split.on), split.set, needs=overlapping))
    stream = getattr(inference, "stream", None)
    if stream is not None and stream.can_prioritise:
        settings.append(Setting(Knob("inference_priority", 0, 1), lambda: int(stream.high_priority),
                                lambda v: stream.set_high_priority(bool(v))))
    prefer = {"sampling": ("gradient_nice", 1), "gradient": ("env_groups", -1), "inference": ("inference_wait_ms", 1),
              "contention": ("take_turns", 1)}
    return Tuner(settings, ledger=ledger, tracer=tracer, window_s=sl.autotune_window_s, log=log, prefer=prefer)
