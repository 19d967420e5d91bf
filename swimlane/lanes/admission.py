"""Admission by weights version (async mode), as a small pure object.

A learner consumes ``chunks_per_update`` chunks per version from the rollout ranks routed
to it, so a rank's ``c``-th batch of episodes belongs to version about
``base + c * senders / chunks_per_update``. Starting it with weights more than
``max_staleness`` versions older than that would produce data the learner drops, so the
sampling lane waits for newer weights first (and, after a while without any, samples
anyway: the learner may be short of data because it dropped a chunk).

The ranks' shares are equal unless a rebalancing plan sets this rank's (:meth:`Admission.
set_share`, :mod:`swimlane.adaptation.balance`): a rank that samples faster than the others is then
expected to deliver more of each version's chunks, and is not held back to the pace of the
slowest.
"""

from __future__ import annotations


class Admission:
    def __init__(self, base: int, chunks_per_update: int, senders: int, max_staleness: int):
        if chunks_per_update < 1 or senders < 1:
            raise ValueError(f"admission: chunks_per_update and senders must be >= 1, "
                             f"got {chunks_per_update} and {senders}")
        self.base = base
        self.per_version = chunks_per_update / senders
        self.max_staleness = max_staleness
        self.started = 0

    def set_share(self, share: float, chunks_per_update: int) -> None:
        """From now on this rank delivers ``share`` (in (0, 1]) of each version's chunks. The
        batches started so far keep the versions they were counted against."""
        if not 0 < share <= 1:
            raise ValueError(f"admission: a share must be in (0, 1], got {share}")
        self.base += self.started / self.per_version
        self.started = 0
        self.per_version = chunks_per_update * share

    def anchor(self, version: int) -> None:
        """Count from ``version`` on, as if starting now: the rank sends to another learner
        (adaptive roles), whose versions its earlier batches say nothing about."""
        self.base, self.started = version, 0

    def needed(self, ahead: int = 0) -> int:
        """The oldest weights version the next batch of episodes may start with (``ahead``:
        the batch after that many more, for episodes that join a chunk still behind others)."""
        return int(self.base + (self.started + ahead) / self.per_version) - self.max_staleness

    def admits(self, latest_version: int, ahead: int = 0) -> bool:
        return latest_version >= self.needed(ahead)

    def start(self) -> None:
        """A batch of episodes started (admitted, or forced after a throttle timeout)."""
        self.started += 1
