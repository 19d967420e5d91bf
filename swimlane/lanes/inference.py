"""The inference lane: batches every pending request into one forward pass on the newest
weights and answers each env group with its share, stamped with the weights version."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import torch

from dvla.contract.checks import ACT_FIX, PolicyError, act_problem
from dvla.types import cat_observations
from swimlane.lanes.channels import Channel
from swimlane.lanes.messages import Reply, Request
from swimlane.lanes.turns import Turns
from swimlane.lanes.streams import LaneStream, tensors_of
from swimlane.observation.trace import Tracer
from swimlane.lanes.weights import DoubleBufferedWeights


def check_first_batch(policy, batch: int, out) -> None:
    """A PolicyError naming the policy when its first actions break the contract (wrong
    shapes, NaN): at once, before any env steps on them (one check: it synchronises a GPU)."""
    problem = act_problem(out, batch, policy.spec)
    if problem is not None:
        name = policy.registry_name or type(policy).__name__
        raise PolicyError(f"policy {name!r} ({type(policy).__module__}.{type(policy).__qualname__}) broke the contract "
                          f"at its first batch of {batch} observations: {problem}. {ACT_FIX}; `dvla check-policy "
                          f"{name}` runs every check")


class InferenceLane:
    """``requests`` in, ``replies`` out. In async mode a step takes every request waiting
    (one forward pass for all groups), after waiting up to :attr:`wait_s` for more while fewer
    than ``groups`` have come; in sync mode one at a time.

    While the rank's lanes take turns (``turns``, :mod:`swimlane.lanes.turns`) the sampling
    lane answers its own requests, in its thread (:meth:`serve`), and this lane's thread
    idles: handing every step to another thread and back costs two thread wake-ups, which on
    a cheap task or too few cores outweighs the overlap the hand-off buys."""

    def __init__(self, *, requests: Channel[Request], replies: Channel[Reply], weights: DoubleBufferedWeights,
                 generator: torch.Generator, tracer: Tracer, batch_all: bool, pool=None, poll_s: float = 0.05,
                 stream: LaneStream | None = None, groups: int | Callable[[], int] = 1, turns: Turns | None = None):
        """``stream``: the CUDA stream its forward passes run on (swimlane/lanes/streams.py);
        ``groups``: the env groups that send requests (at most one each is pending), or a
        function giving how many step now (a wait for more never outlasts them);
        ``turns``: the rank's switch between overlapping lanes and taking turns."""
        self.requests, self.replies = requests, replies
        self.weights, self.generator, self.tracer = weights, generator, tracer
        self.batch_all, self.pool, self.poll_s = batch_all, pool, poll_s
        self.stream, self.groups = stream, groups
        self.wait_s = 0.0  # async: how long a forward pass waits for more groups (swimlane.autotune moves it)
        self.turns = turns or Turns()
        self._lock = threading.Lock()  # one forward pass at a time (the generator, the pool lease)
        self._checked = False  # the first batch of actions is checked against the policy contract

    def poll(self) -> bool:
        """For the serial driver: answer what is waiting, without blocking."""
        return self.step(timeout=0.0)

    def run(self, stopping: Callable[[], bool]) -> None:
        while not stopping():
            if self.turns.on:
                self.turns.threads_free.wait(self.poll_s)
            else:
                self.step(timeout=self.poll_s)

    def serve(self) -> bool:
        """While the lanes take turns: answer the requests waiting, in the calling thread;
        False otherwise or when none waits. (A request this lane's thread took just before
        the switch is answered there; replies arrive either way.)"""
        return self.turns.on and self.step(0.0)

    @torch.no_grad()
    def step(self, timeout: float = 0.0) -> bool:
        """Answer the requests waiting (wait up to ``timeout`` for one); False if none came."""
        first = self.requests.get(timeout)
        if first is None:
            return False
        with self._lock:
            self._answer_all(first)
        return True

    def _answer_all(self, first: Request) -> None:
        reqs: list[Request] = [first]
        while self.batch_all and (more := self.requests.get(0.0)) is not None:
            reqs.append(more)
        if self.batch_all and self.wait_s > 0 and not self.turns.on and len(reqs) < (
                groups := self.groups() if callable(self.groups) else self.groups):
            with self.tracer.span("inference", "wait"):
                deadline = time.perf_counter() + self.wait_s
                while len(reqs) < groups and (left := deadline - time.perf_counter()) > 0:
                    if (more := self.requests.get(left)) is not None:
                        reqs.append(more)
        policy, version = self.weights.acquire()
        for kind in ("act", "value"):
            batch = [r for r in reqs if r.kind == kind]
            if batch:
                with self.tracer.span("inference", "infer" if kind == "act" else "value"):
                    self._answer(policy, version, kind, batch)

    def _answer(self, policy, version: int, kind: str, batch: list[Request]) -> None:
        lease = self.pool.lease() if self.pool is not None else None
        with self.stream.use() if self.stream is not None else contextlib.nullcontext():
            obs = cat_observations([r.obs for r in batch], lease.empty if lease is not None else None)
            out = policy.act(obs, generator=self.generator) if kind == "act" else policy.value(obs)
            if kind == "act" and not self._checked:
                check_first_batch(policy, obs.batch_size, out)
                self._checked = True
        if self.stream is not None:
            self.stream.hand_over(tensors_of(out))
        if lease is not None:
            lease.release()
        start = 0
        for r in batch:
            n = r.obs.batch_size
            if len(batch) == 1:
                part = out
            else:
                part = out.rows(start, start + n) if kind == "act" else out[start : start + n]
            self.replies.put(Reply(r.group, kind, part, version))
            start += n
