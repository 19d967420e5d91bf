"""The learner (gradient) lane: collects chunks, rejects those that fail the job's checks
(:mod:`swimlane.lanes.validate`), drops those too stale to learn from, learns from each full
set, and hands the result to the run (metrics, checkpoints, snapshots for the publish
lane) through ``finish_update``.

Rejected and dropped chunks are not progress: the stall timer only counts chunks the
learner can use. An update whose loss or gradient is not finite has its optimizer steps
skipped (the algorithm's ``non_finite_steps``) and is counted; ``max_bad_updates`` of
them in a row stop the run.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from dvla.types import RolloutBatch
from swimlane.observation.throughput import Throughput
from swimlane.lanes.chunks import concat
from swimlane.observation.health import StallTimer
from swimlane.observation.ledger import Ledger
from swimlane.observation.trace import Tracer
from swimlane.lanes.validate import ChunkSpec, check_chunk

log = logging.getLogger("dvla.swimlane")


def env_steps(batch: RolloutBatch, independent: bool = False) -> int:
    """Env steps simulated for a chunk: decisions taken x envs (as the sync trainer counts);
    for envs on their own clock (``independent``), the decisions its episodes took."""
    if independent:
        return int(batch.valid.sum())
    return int(batch.valid.any(dim=1).sum()) * batch.num_envs


def sender_of(meta: dict) -> str:
    """Who sent a chunk: the name of the connection it came on (``sender``, set by the
    data plane, :mod:`planes.identity`), else (in one process) ``rank<N>`` from its meta."""
    who = meta.get("sender")
    return str(who if who is not None else f"rank{meta.get('rank')}")[:40]


def _names(ranks) -> str:
    """Senders for a message: sorted, at most 8."""
    names = sorted({str(r)[:40] for r in ranks})
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


@dataclass(kw_only=True)
class GradientConfig:
    need: int  # chunks per update
    max_staleness: int
    iterations: int
    stop_rollouts_before_last: bool  # async: nobody consumes what is sampled after the last update's data
    spec: ChunkSpec | None = None  # what a legal chunk looks like (None: no checks)
    max_bad_updates: int = 3  # non-finite updates in a row that stop the run
    max_rejected: int = 64  # a sender's chunks rejected in a row (none usable between) that cut it off
    senders: tuple[str, ...] = ()  # the job's senders to this learner; the run stops when all are cut off
    independent: bool = False  # chunks of envs on their own clock (how env steps are counted)
    poll_s: float = 0.05


@dataclass
class Update:
    """What one learner step produced, for the run to log and act on."""

    batch: RolloutBatch | None  # None: this learner sat the update out (no chunks)
    learn: dict[str, float]
    learn_s: float
    env_steps: int  # consumed by this learner since the lane started
    wait_s: float = 0.0  # waiting for its chunks


class GradientLane:
    def __init__(self, *, source, algo, generator: torch.Generator, ledger: Ledger, tracer: Tracer,
                 cfg: GradientConfig, version: Callable[[], int], finish_update: Callable[[Update], bool],
                 check_health: Callable[[StallTimer], None], stall: StallTimer,
                 idle: Callable[[], None] = lambda: None, stop_rollouts: Callable[[], None] = lambda: None,
                 activations: Callable[[], ContextManager] = contextlib.nullcontext,
                 before_update: Callable[[], bool] = lambda: True,
                 turn: Callable[[], ContextManager] = contextlib.nullcontext,
                 throughput: Throughput | None = None, learning: Callable[[], bool] | None = None):
        """``version()``: the weights version being trained; ``finish_update(update)`` logs,
        checkpoints and publishes, and returns True after the last update;
        ``check_health(stall)`` raises when the run cannot go on (dead senders, a stall);
        ``idle()`` runs between polls (a skipped snapshot hand-over, say);
        ``before_update()`` gates the update's collectives (:mod:`swimlane.agreement.ordering`), False
        when the run stopped while waiting; ``turn()``: the context an update runs in
        (:class:`swimlane.lanes.turns.Turns`); ``throughput``: where every usable or stale
        chunk is counted per rollout rank and env group (:mod:`swimlane.adaptation.balance`).

        ``learning()`` (a learner rank that switches roles, :mod:`swimlane.adaptation.roles`): whether
        the plan has it learn in the next update. Such a lane passes ``before_update`` first,
        so that the plan of the version before is in; then it waits for ``need`` chunks only
        when learning, else takes what is already queued (maybe nothing: it sits the update
        out, :meth:`dvla.algos.base.Algorithm.follow`)."""
        self.source, self.algo, self.generator = source, algo, generator
        self.ledger, self.tracer, self.cfg = ledger, tracer, cfg
        self.version, self.finish_update = version, finish_update
        self.check_health, self.stall, self.idle = check_health, stall, idle
        self.stop_rollouts, self.activations, self.before_update = stop_rollouts, activations, before_update
        self.turn, self.throughput, self.learning = turn, throughput, learning
        self.consumed_steps = 0
        self.bad_in_a_row = 0
        # sender -> its rejected chunks by reason, since its last usable one
        self.rejected_in_a_row: dict[str, collections.Counter] = {}
        self.cut_off: dict[str, str] = {}  # sender -> why its chunks are all dropped
        self._senders: list[Any] = []  # ranks that sent the chunks of the update being collected
        self._bad_senders: set[Any] = set()  # ... of the non-finite updates in a row
        self._pending: tuple[list[RolloutBatch], list[Any]] = ([], [])  # poll(): chunks so far
        self.done = False  # poll(): the last update is made

    def reject(self, item) -> bool:
        """Refuse (counted, logged) a chunk that fails the job's checks, or that comes from a
        sender already cut off. A sender whose last ``max(max_rejected, 4 * need)`` chunks
        were all refused is cut off: its later chunks are dropped (``rejected_cut_off``) and
        the run goes on with the other senders; it stops only when every sender of the job
        is cut off, naming them and why."""
        batch, meta, on_done = item
        who = sender_of(meta)
        if who in self.cut_off:
            bad = ("cut_off", self.cut_off[who])
        else:
            bad = check_chunk(batch, self.cfg.spec, self.version()) if self.cfg.spec is not None else None
        if bad is None:
            return False
        reason, detail = bad
        self.ledger.add(f"rejected_{reason}")
        if on_done is not None:
            on_done()
        if reason == "cut_off":
            return True
        n = self.ledger[f"rejected_{reason}"]
        if n <= 5 or n % 100 == 0:
            log.error("rejected a chunk from %s (%s, %d so far): %s", who, reason, n, detail)
        run = self.rejected_in_a_row.setdefault(who, collections.Counter())
        run[reason] += 1
        in_a_row = sum(run.values())
        if in_a_row >= max(self.cfg.max_rejected, 4 * self.cfg.need):
            reasons = ", ".join(f"{r}: {k}" for r, k in run.items())
            self.cut_off[who] = f"its last {in_a_row} chunks were all rejected ({reasons}; the last: {detail})"
            del self.rejected_in_a_row[who]
            log.error("cut off %s: %s; its further chunks are dropped", who, self.cut_off[who])
            if not self.cfg.senders or set(self.cfg.senders) <= set(self.cut_off):
                why = "; ".join(f"{s}: {w}" for s, w in sorted(self.cut_off.items())[:8])
                raise RuntimeError(
                    f"every chunk is rejected, every sender is cut off ({why}). No update can be made: "
                    f"a policy that acts NaN, or rollouts built for another job")
        return True

    def accept(self, item, chunks: list[RolloutBatch], releases: list[Any]) -> None:
        """Keep a received chunk, or refuse it (counted) when it fails the checks or is too
        stale."""
        if self.reject(item):
            return
        batch, meta, on_done = item
        steps = env_steps(batch, self.cfg.independent)
        self.ledger.add("env_steps_sampled", steps)
        lag = self.version() - int(batch.policy_version[batch.valid].min()) if batch.valid.any() else 0
        if self.throughput is not None:
            self.throughput.add(meta, steps, dropped=lag > self.cfg.max_staleness)
        if lag > self.cfg.max_staleness:
            self.ledger.add("dropped_stale")
            now = time.perf_counter()
            self.tracer.add("gradient", "stale_drop", now, now)
            if on_done is not None:
                on_done()
            return
        self.stall.progress()  # a chunk the learner can use
        who = sender_of(meta)
        self.rejected_in_a_row.pop(who, None)
        self._senders.append(who)
        self.consumed_steps += steps
        chunks.append(batch)
        releases.append(on_done)

    def collect(self, stop: threading.Event, wait: bool = True) -> tuple[list[RolloutBatch], list[Any]] | None:
        """``need`` chunks the learner can use (and their release callbacks), or None if
        the run stopped first (what was collected is counted as discarded). Without
        ``wait``: what is queued now, up to ``need`` (maybe none)."""
        chunks: list[RolloutBatch] = []
        releases: list[Any] = []
        self._senders = []
        while len(chunks) < self.cfg.need and not stop.is_set():
            self.idle()
            with self.tracer.span("gradient", "wait"):
                item = self.source.get(timeout=self.cfg.poll_s if wait else 0.0)
            if item is None:
                if not wait:
                    return chunks, releases
                self.check_health(self.stall)
                continue
            self.accept(item, chunks, releases)
        if len(chunks) < self.cfg.need:
            self.ledger.add("discarded_after_run", len(chunks))  # stopped mid-collection
            return None
        return chunks, releases

    def step(self, stop: threading.Event) -> bool:
        """Collect, learn once, finish the update; False when the lane should end."""
        gated = self.learning is not None
        if gated and not self.before_update():
            return False
        t0 = time.perf_counter()
        got = self.collect(stop, wait=not gated or self.learning())
        if got is None:
            return False
        return self.learn(*got, wait_s=time.perf_counter() - t0, gated=gated)

    def poll(self) -> bool:
        """For the serial driver: take one waiting chunk without blocking, and learn once
        ``need`` have arrived. True if it did anything."""
        item = self.source.get(timeout=0.0)
        if item is None:
            return False
        pending = self._pending
        self.accept(item, *pending)
        if len(pending[0]) == self.cfg.need:
            self._pending = ([], [])
            self.done = not self.learn(*pending)
        return True

    def learn(self, chunks: list[RolloutBatch], releases: list[Any], wait_s: float = 0.0,
              gated: bool = False) -> bool:
        """One update from ``chunks`` (none: this learner sits it out); False after the last
        one (or a stop). ``gated``: ``before_update`` was passed already."""
        if not gated and not self.before_update():
            self.ledger.add("discarded_after_run", len(chunks))
            for release in releases:
                if release is not None:
                    release()
            return False
        if self.cfg.stop_rollouts_before_last and self.version() + 1 >= self.cfg.iterations:
            self.stop_rollouts()  # the last update has its data
        batch = concat(chunks) if chunks else None
        self.ledger.add("chunks_consumed", len(chunks))
        t0 = time.perf_counter()
        with self.turn(), self.tracer.span("gradient", "learn" if chunks else "follow"), self.activations():
            if chunks:
                learn = self.algo.update(batch, self.generator, learner_version=self.version())
            else:
                learn = {"samples": 0.0, **self.algo.follow(self.version())}
                self.ledger.add("updates_sat_out")
        senders, self._senders = self._senders, []
        self.check_finite(learn, senders)
        update = Update(batch=batch, learn=learn, learn_s=time.perf_counter() - t0, env_steps=self.consumed_steps,
                        wait_s=wait_s)
        del chunks, batch
        try:
            last = self.finish_update(update)
        finally:
            del update
            for release in releases:  # the rollout buffers go back to the transient pool
                if release is not None:
                    release()
        return not last

    def check_finite(self, learn: dict[str, float], senders: list[Any] = ()) -> None:
        """Count an update whose optimizer steps were skipped for a non-finite loss or
        gradient; stop the run after ``max_bad_updates`` of them in a row, naming the ranks
        that sent their chunks (``senders``). An update whose weights are finite but make the
        policy's distribution NaN or inf on the batch it learned from stops the run at once:
        its weights are never published nor checkpointed."""
        if learn.get("non_finite_distribution"):
            raise RuntimeError(
                f"the update from version {self.version()} made the policy's action distribution NaN or inf on "
                f"the batch it learned from (its weights are finite: a learning rate, algo.lr={self.algo.cfg.lr}, "
                f"or a reward scale too large for this model?); not published, stopping: the weights published "
                f"and checkpointed are those of version {self.version()} and before (counters: {self.ledger.counts})")
        if not learn.get("non_finite_steps", 0.0):
            self.bad_in_a_row = 0
            self._bad_senders.clear()
            return
        self.ledger.add("updates_non_finite")
        self.bad_in_a_row += 1
        self._bad_senders.update(senders)
        log.error("update at version %d: non-finite loss or gradient in %.0f%% of its steps (skipped), %d in a row",
                  self.version(), 100 * learn["non_finite_steps"], self.bad_in_a_row)
        if self.bad_in_a_row >= self.cfg.max_bad_updates:
            raise RuntimeError(
                f"{self.bad_in_a_row} updates in a row had a non-finite loss or gradient (swimlane.max_bad_updates="
                f"{self.cfg.max_bad_updates}); their steps were skipped and the weights are unchanged since version "
                f"{self.version() - self.bad_in_a_row}. Their chunks were sent by "
                f"{_names(self._bad_senders) or 'unknown'}. Check the reward scale, "
                f"the learning rate and those ranks' chunks (counters: {self.ledger.counts})")

    def run(self, stop: threading.Event) -> None:
        while self.version() < self.cfg.iterations and not stop.is_set() and self.step(stop):
            pass
