"""How trajectory chunks travel from the sampling lane to the gradient lane.

A chunk is one env group's batch of episodes (a :class:`RolloutBatch`) plus a little
metadata (producing rank and group, a per-sender sequence number). In one process it
goes through a bounded in-process queue; across processes over the ZeroMQ data plane
(:mod:`planes.data`), where each tensor is a zero-copy frame. Both sides of both paths
are channels of :class:`swimlane.lanes.channels.Chunk` ``(batch, meta, on_done)``
(``put(chunk, stop)``, ``get(timeout)``), and a sink also has ``end(meta)``: this sender
is done. ``on_done`` (optional) is called once the chunk's memory is no longer needed: by the learner after its update in one process, by
the data plane once ZeroMQ has sent the frames across processes. The swimlane uses it
to give rollout buffers back to the transient memory pool.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any

import torch

from dvla.types import NESTED, RolloutBatch
from planes.data import TrajectoryReceiver, TrajectorySender
from swimlane.lanes.channels import Chunk, LocalChannel
from swimlane.observation.ledger import chunk_accounting

CHUNK_KIND = "chunk"
END_KIND = "end"
FIELDS = {f.name: f for f in dataclasses.fields(RolloutBatch) if f.name not in NESTED}
DTYPES = {"image": torch.uint8, "instruction_ids": torch.int64, "instruction_mask": torch.bool, "policy_version": torch.int64,
           "group_ids": torch.int64, "terminated": torch.bool, "truncated": torch.bool, "valid": torch.bool,
           "success": torch.bool, "action_valid": torch.bool}


class ChunkError(ValueError):
    """A received chunk does not describe a valid RolloutBatch."""


def batch_from_tensors(tensors: dict[str, torch.Tensor],
                       fields: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None) -> RolloutBatch:
    """Check names, dtypes and shapes of received tensors and build the batch. ``fields``:
    the job's further tensors, name -> (dtype, shape per step and env): the policy's cameras
    (``cameras.<name>``) and rollout extras (``extras.<name>``), each ``(T, B, *shape)``
    (:meth:`swimlane.lanes.validate.ChunkSpec.optional_fields`)."""
    fields = fields or {}
    names = FIELDS.keys() | fields.keys()
    missing = names - tensors.keys()
    extra = tensors.keys() - names
    if missing or extra:
        raise ChunkError(f"chunk fields: missing {sorted(missing)}, unexpected {sorted(extra)}")
    for name, t in tensors.items():
        want = fields[name][0] if name in fields else DTYPES.get(name, torch.float32)
        if t.dtype != want:
            raise ChunkError(f"chunk field {name}: dtype {t.dtype}, expected {want}")
    t_len, b = tensors["rewards"].shape if tensors["rewards"].dim() == 2 else (-1, -1)
    lead = {"image": (t_len, b), "proprio": (t_len, b), "actions": (t_len, b), "log_probs": (t_len, b),
            "rewards": (t_len, b), "terminated": (t_len, b), "truncated": (t_len, b), "valid": (t_len, b),
            "policy_version": (t_len, b), "values": (t_len + 1, b), "success": (b,), "group_ids": (b,),
            "instruction_ids": (b,), "instruction_mask": (b,), "action_valid": (t_len, b), "action_log_probs": (t_len, b),
            "bootstrap": (t_len, b), "episode_sums": (b,)}
    lead.update({name: (t_len, b, *shape) for name, (_, shape) in fields.items()})
    for name, shape in lead.items():
        if t_len < 0 or tuple(tensors[name].shape[: len(shape)]) != shape:
            raise ChunkError(f"chunk field {name}: shape {tuple(tensors[name].shape)} does not start with {shape}")
    return RolloutBatch.from_dict(tensors)


def concat(batches: list[RolloutBatch]) -> RolloutBatch:
    """Join chunks along the env dimension (all have the same ``T``)."""
    if len(batches) == 1:
        return batches[0]
    per_env = {"success", "group_ids", "instruction_ids", "instruction_mask", "episode_sums"}
    parts = [b.to_dict() for b in batches]
    return RolloutBatch.from_dict({
        name: torch.cat([p[name] for p in parts], dim=0 if name in per_env else 1) for name in parts[0]
    })


class LocalChunks(LocalChannel[Chunk]):
    """In-process, bounded: ``put`` blocks while the learner is ``capacity`` chunks behind."""

    def end(self, meta: dict[str, Any]) -> None:
        pass


class RemoteChunkSink:
    """Rollout side of the data plane: chunks to the learner rank ``learner``."""

    def __init__(self, sender: TrajectorySender, learner: int):
        self.sender, self.learner = sender, learner

    def put(self, chunk: Chunk, stop: threading.Event | None = None) -> bool:
        self.sender.send(CHUNK_KIND, chunk.batch.to_dict(), chunk.meta, on_done=chunk.on_done)
        return True

    def end(self, meta: dict[str, Any]) -> None:
        self.sender.send(END_KIND, {}, meta)

    def close(self) -> None:
        self.sender.close()


class RoutedSink:
    """Rollout side with adaptive roles (:mod:`swimlane.adaptation.roles`): a sender to every learner
    candidate, each chunk to the learner the plan names now. Each learner is told, at the
    end, how many chunks it was sent."""

    def __init__(self, sinks: dict[int, RemoteChunkSink], learner: int):
        self.sinks, self.learner = sinks, learner
        self.sent: collections.Counter = collections.Counter()  # learner -> chunks sent to it

    @property
    def sender(self) -> TrajectorySender:
        """The sender of the current route."""
        return self.sinks[self.learner].sender

    def set_route(self, learner: int) -> None:
        if learner not in self.sinks:
            raise ValueError(f"no sender to rank {learner}: the candidates are {sorted(self.sinks)}")
        self.learner = learner

    def put(self, chunk: Chunk, stop: threading.Event | None = None) -> bool:
        learner = self.learner  # one read: a plan may move the route meanwhile
        self.sinks[learner].put(chunk, stop)
        self.sent[learner] += 1
        return True

    def end(self, meta: dict[str, Any]) -> None:
        for learner, sink in self.sinks.items():
            sink.end({**meta, "chunks": self.sent[learner]})

    def close(self) -> None:
        for sink in self.sinks.values():
            sink.close()


class RemoteChunkSource:
    """Learner side of the data plane; invalid chunks are counted and skipped."""

    def __init__(self, receiver: TrajectoryReceiver, fields: dict[str, Any] | None = None):
        """``fields``: the further tensors a chunk must carry (see :func:`batch_from_tensors`)."""
        self.receiver, self.fields = receiver, fields or {}
        self.ended: dict[str, int] = {}  # sender -> chunks it says it sent in all
        self.received: collections.Counter = collections.Counter()  # sender -> chunk messages
        self.invalid = 0

    def get(self, timeout: float) -> Chunk | None:
        """The next valid chunk, or None. The data plane has tied ``msg.sender`` to the
        connection it came on (:mod:`planes.identity`); the chunk's ``meta`` gets it as
        ``sender``, and a ``rank`` in ``meta`` must agree with it."""
        msg = self.receiver.get(timeout=timeout)
        if msg is None:
            return None
        if msg.kind == END_KIND:
            total = msg.meta.get("chunks", self.received[msg.sender])
            # Every chunk of this sender came before its end on the same connection; it can
            # have sent at most as many messages as its end's sequence number says.
            if not isinstance(total, int) or isinstance(total, bool) or not 0 <= total <= msg.seq:
                self._reject(msg.sender, f"end claims {total!r} chunks sent, before message {msg.seq}")
                total = self.received[msg.sender]
            self.ended[msg.sender] = total
            return None
        self.received[msg.sender] += 1
        try:
            if msg.kind != CHUNK_KIND:
                raise ChunkError(f"unexpected message kind {msg.kind!r}")
            rank = msg.meta.get("rank")
            if rank is not None and f"rank{rank}" != msg.sender:
                raise ChunkError(f"meta claims rank {str(rank)[:20]!r}, but the chunk came from {msg.sender!r}")
            meta = {**msg.meta, "sender": msg.sender}
            return Chunk(batch_from_tensors(msg.tensors, self.fields), meta, None)
        except ChunkError as exc:
            self.invalid += 1
            self._reject(msg.sender, exc)
            return None

    def _reject(self, sender: str, why) -> None:
        self.receiver.counters.rejected["invalid_chunk"] += 1
        logging.getLogger("dvla.swimlane").error("rejected chunk from %s: %s", sender, why)

    def depth(self) -> int:
        return self.receiver.depth()

    def accounting(self, counters: dict[str, int], expected: list[str]) -> dict[str, int]:
        """Where every chunk sent to this learner went (:func:`swimlane.observation.ledger.chunk_accounting`),
        ``expected``: the senders routed here."""
        return chunk_accounting(counters, local=False, invalid=self.invalid, ended=self.ended,
                                reported=self.receiver.reported_sent, received=self.received,
                                dead=self.receiver.dead_peers, expected=expected)

    def senders_gone(self, expected: list[str]) -> bool:
        """Every sender in ``expected`` said it ended, or its heartbeats stopped."""
        gone = set(self.ended) | set(self.receiver.dead_peers)
        return all(s in gone for s in expected)

    def close(self) -> None:
        self.receiver.close()
