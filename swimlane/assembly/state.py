"""What a rank's lanes share with its run, as one plain object: the weights version being
trained, the counters (:class:`swimlane.observation.ledger.Ledger`), the trace, the events
that stop the lanes, and the run's flags. Each field has one writer (the gradient lane for
the version and the flags it sets, the launcher's signal handler for ``preempted``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from dvla.config import JobConfig
from swimlane.agreement.checkpoints import Resumed
from swimlane.observation.ledger import Ledger
from swimlane.observation.trace import Tracer

POLL_S = 0.05  # how often a waiting lane looks at its stop events
THROTTLE_S = 2.0  # longest a rollout rank waits for newer weights while producing nothing


class RunState:
    def __init__(self, cfg: JobConfig, rank: int, world_size: int, resumed: Resumed | None, restarts: int):
        sl = cfg.swimlane
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.iterations = cfg.run.iterations
        self.out_dir = Path(cfg.run.out_dir)
        self.restarts = restarts
        self.attempt: int | None = None  # rank 0: this attempt's number (swimlane.assembly.summary.claim_attempt)
        self.tracer = Tracer(sl.trace)
        self.ledger = Ledger()  # counters (a resume carries the earlier attempts' totals)
        self.stop_event = threading.Event()  # hard stop: an error, request_stop(), SIGTERM
        self.rollout_stop = threading.Event()  # the learner is done: rollout lanes wind down
        self.learner_done = threading.Event()
        self.version, self.resumed_from = 0, None
        if resumed is not None:
            self.version = self.resumed_from = resumed.version
            self.ledger.carry(resumed.counters, resumed.env_steps)
        self.env_steps = self.ledger.carried_env_steps  # consumed over all learners, all attempts
        self.time_up = False  # run.time_limit_s reached
        self.preempted = False  # SIGTERM: checkpoint on the way out
        # SIGTERM on a job of several learners: they agree on it at the next update and end
        # there together (as at run.iterations), since none can leave the others' collectives.
        self.stop_asked = self.stop_agreed = False
        self.last_good_version = self.version  # the newest version whose weights were finite when checked
        self.learning = rank == 0 or sl.roles == "fixed"  # this rank learns in the next update
        self.history: list[dict] = []  # rank 0: every update's metrics record
        self.tids: dict[str, int] = {}  # lane -> its thread's native id (swimlane.autotune)
        self.start_time = time.perf_counter()
        self.start_unix = time.time()

    def started(self) -> None:
        """The lanes start now: the run's clocks (the report aligns ranks by the wall clock)."""
        self.start_time = time.perf_counter()
        self.start_unix = time.time()

    def request_stop(self) -> None:
        """Stop every lane soon (signal handlers call this)."""
        self.stop_event.set()
        self.rollout_stop.set()

    def rollout_stopping(self) -> bool:
        return self.rollout_stop.is_set() or self.stop_event.is_set()
