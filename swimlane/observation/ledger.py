"""What one rank's run counted, and where every chunk sent to a learner went.

Plain objects, no threads: each counter has one writer (the lane named in
:data:`COUNTERS`), so increments need no lock; readers (metrics, the summary) tolerate a
value one step old. A resumed run carries the totals of the attempts before it.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping

COUNTERS: dict[str, str] = {
    "chunks_sent": "sampling",
    "env_errors": "sampling",
    "throttle_timeouts": "sampling",
    # Env steps of the envs taking decisions, and of envs stepped while their episode had
    # ended (waiting for the rest of their batch, or of their GRPO group).
    "env_steps_live": "sampling",
    "env_steps_idle": "sampling",
    "chunks_reissued": "sampling",  # sync, swimlane.reissue: batches sampled again while waiting for weights
    "env_steps_sampled": "gradient",
    "chunks_consumed": "gradient",
    "dropped_stale": "gradient",
    # Chunks the learner refused (swimlane.lanes.validate.REASONS), and updates whose loss or
    # gradient was not finite (their optimizer steps skipped).
    "rejected_shape": "gradient",
    "rejected_instruction_ids": "gradient",
    "rejected_non_finite": "gradient",
    "rejected_range": "gradient",
    "rejected_version": "gradient",
    "rejected_extras": "gradient",
    "rejected_episodes": "gradient",
    "rejected_cut_off": "gradient",  # chunks of a sender cut off after a run of rejected ones
    "updates_non_finite": "gradient",
    "updates_sat_out": "gradient",  # adaptive roles: updates this learner rank took part in without chunks
    "publish_skipped_busy": "gradient",
    # The gradient lane while it runs (a collection cut short), then the supervisor's drain
    # once it has ended: never both at once.
    "discarded_after_run": "gradient",
    "publishes": "broadcast",
}
"""Counter name -> the lane that writes it."""


class Ledger:
    """This attempt's counters, plus what the attempts before a resume counted."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.changed: dict[str, float] = {}  # counter -> perf_counter() of its last add
        self.carried: dict[str, int] = {}
        self.carried_env_steps = 0

    def add(self, name: str, n: int = 1) -> None:
        if name not in self.counts:
            raise KeyError(f"unknown counter {name!r}; known: {', '.join(COUNTERS)}")
        self.changed[name] = time.perf_counter()  # first: a reader seeing the new count sees its time
        self.counts[name] += n

    def __getitem__(self, name: str) -> int:
        return self.counts[name]

    def carry(self, counters: Mapping[str, int], env_steps: int) -> None:
        """Totals of the attempts before this one (from a checkpoint's manifest)."""
        self.carried = {k: int(v) for k, v in counters.items()}
        self.carried_env_steps = int(env_steps)

    def totals(self) -> dict[str, int]:
        """This attempt's counts plus the carried ones (a counter unknown to an older
        checkpoint starts at this attempt's count)."""
        return {k: v + self.carried.get(k, 0) for k, v in self.counts.items()}


def rejected_by_learner(counts: Mapping[str, int]) -> int:
    return sum(v for k, v in counts.items() if k.startswith("rejected_"))


def chunk_accounting(counts: Mapping[str, int], *, local: bool, invalid: int = 0,
                     ended: Mapping[str, int] | None = None, reported: Mapping[str, int] | None = None,
                     received: Mapping[str, int] | None = None, dead: Iterable[str] = (),
                     expected: Iterable[str] = ()) -> dict[str, int]:
    """Where every chunk sent to a learner went. ``sent`` (in one process, this rank's own
    count; else what each sender reported: its end-of-run total, or heartbeats and
    sequence numbers for one that died) is the sum of ``received`` (consumed, dropped
    stale, rejected as invalid by the data plane or by the learner's checks, discarded
    after the run), ``lost_dead_peer`` (sent by a
    sender that died, never arrived) and ``in_flight_at_exit`` (a live sender's chunks not
    yet arrived when the run stopped); ``unaccounted`` must be 0."""
    acc: dict[str, Any] = {"consumed": counts["chunks_consumed"], "dropped_stale": counts["dropped_stale"],
                           "rejected_invalid": 0, "rejected_by_learner": rejected_by_learner(counts),
                           "discarded_after_run": counts["discarded_after_run"],
                           "lost_dead_peer": 0, "in_flight_at_exit": 0}
    if local:
        acc["sent"] = counts["chunks_sent"]
    else:
        ended, reported, received = ended or {}, reported or {}, received or {}
        dead = set(dead)
        acc["rejected_invalid"] = invalid
        acc["sent"] = 0
        for sender in sorted(set(expected) | set(received) | set(reported)):
            sent = ended.get(sender, reported.get(sender, 0))
            acc["sent"] += sent
            missing = sent - received.get(sender, 0)
            acc["lost_dead_peer" if sender in dead else "in_flight_at_exit"] += missing
    acc["received"] = sum(acc[k] for k in ("consumed", "dropped_stale", "rejected_invalid", "rejected_by_learner",
                                           "discarded_after_run"))
    acc["unaccounted"] = acc["sent"] - acc["received"] - acc["lost_dead_peer"] - acc["in_flight_at_exit"]
    return acc
