"""A rank's parts, built from its plan (:mod:`swimlane.assembly.plan`) in one straight pass.

:func:`assemble` is the only caller of the builders in :mod:`swimlane.assembly.build`, and calls
them in the order their parts depend on each other: memory pools and streams, process
groups, envs, policy and algorithm, the starting state (a resumed checkpoint, agreed by
every learner; the normalisation, sent to every rank), the imbalance planner, weight
buffers, learner sharding, the data plane and the learners' order of collectives.
:func:`swimlane.assembly.wiring.connect` wires the parts to the rank's lanes, and
:func:`as_built` reads back from them what was built, in the plan's terms.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dvla.state.checkpoint import CheckpointManager
from dvla.config import JobConfig
from dvla.distributed import resolve_device
from dvla.envs import env_spec
from launch.placement import Placement
from memory import runtime
from launch.topology import Topology
from planes.data import DataPlaneConfig
from swimlane.agreement.start import agree
from swimlane.adaptation.balance import WORDS_PER_RANK
from swimlane.assembly.build import (
    Groups,
    build_data_plane,
    build_groups,
    build_memory,
    build_model,
    build_streams,
    build_weights,
    check_world,
    persistent_alloc,
    place_ranks,
    prepare_learner,
    share_normalization,
)
from dvla.metrics import truncate_metrics
from swimlane.agreement.checkpoints import Resumed, RunCheckpoints, resume_learner
from swimlane.adaptation.imbalance import RankBalance
from swimlane.agreement.ordering import CollectiveOrder
from swimlane.assembly.plan import (Broadcast, Chunks, Groups as PlannedGroups, Pools, RankPlan, Route, Stream, check_job,
                                    plan_rank)
from swimlane.lanes.streams import LaneStream
from swimlane.lanes.validate import ChunkSpec

log = logging.getLogger("dvla.swimlane")


@dataclass
class RankParts:
    plan: RankPlan
    device: torch.device
    topology: Topology
    placement: Placement
    memory: Any  # memory.MemoryManager, or None (memory.enabled=false)
    host_pool: Any  # the pool rollout buffers come from
    streams: dict[str, LaneStream]
    groups: Groups
    envs: list
    policy: torch.nn.Module
    algo: Any  # learners only
    sample_gen: torch.Generator
    learn_gen: torch.Generator | None
    chunk_spec: ChunkSpec
    checkpoints: RunCheckpoints | None  # learners only
    resumed: Resumed | None
    balance: RankBalance
    weights: Any  # DoubleBufferedWeights (rollout ranks)
    snapshot: Any  # rank 0
    snap_flats: list[torch.Tensor] | None
    bc: Any  # WeightBroadcaster (several processes)
    source: Any  # where chunks arrive (learners)
    sink: Any  # where chunks go (rollout ranks)
    expected_senders: list[str]
    order: CollectiveOrder

    @property
    def publish_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.plan.broadcast.dtype == "bf16" else torch.float32


def plan_of(cfg: JobConfig, rank: int = 0, world_size: int = 1) -> tuple[RankPlan, Topology, Placement]:
    """The rank's plan, with the topology (given, or discovered through the store) and the
    placement it was made from."""
    check_world(cfg.swimlane, world_size)
    topology, placement = place_ranks(cfg.swimlane, rank, world_size)
    check_job(cfg, topology, placement)
    return plan_rank(cfg, rank, topology, placement, resolve_device(cfg.run.device)), topology, placement


def assemble(cfg: JobConfig, rank: int = 0, world_size: int = 1, data_plane: DataPlaneConfig | None = None,
             restarts: int = 0, poll_s: float = 0.05) -> RankParts:
    """Everything a rank needs before its lanes start, built as its plan says."""
    sl = cfg.swimlane
    plan, topology, placement = plan_of(cfg, rank, world_size)
    device = torch.device(plan.device)
    runtime.for_device(device).bind_thread()  # the building thread, as every lane's (memory/runtime.py)
    memory, host_pool = build_memory(plan.pools, cfg.memory, device)
    streams = build_streams(plan.streams, device)
    groups = build_groups(plan.groups, sl.collective_timeout_s, device)
    model = build_model(cfg, plan, device, groups, memory)
    # The env's declared reward range and the job's value bounds (issue #38): a learner
    # rejects chunks beyond them before any update.
    spec = model.envs[0].spec if model.envs else env_spec(cfg.env)  # (a learner-only rank builds no env)
    chunk_spec = ChunkSpec.for_policy(model.policy, cfg.env.n_envs, cfg.chunk_len, env_spec=spec, algo=cfg.algo)

    checkpoints = resumed = None
    if plan.learner:  # learners resume from the newest valid checkpoint; rank 0 writes them
        manager = CheckpointManager(Path(cfg.run.out_dir) / "checkpoints", keep=cfg.run.keep_checkpoints)
        generators = {"learn": model.learn_gen, **({"sample": model.sample_gen} if rank == 0 else {})}
        checkpoints = RunCheckpoints(manager, model.policy, model.algo, generators)
        resumed = _resume(cfg, checkpoints, rank, restarts, groups, placement, device)
    # Every rank acts with rank 0's normalisation: installed before the replicas are copied.
    share_normalization(cfg, model, rank, world_size, resumed if rank == 0 else None)

    # Imbalance between rollout ranks and who learns: measured by every learner, planned by
    # rank 0, the plan sent with each version (swimlane/adaptation/imbalance.py, swimlane/adaptation/roles.py).
    balance = RankBalance(sl, rank, world_size, placement, plan.routes, groups.learner)
    buffers = build_weights(model.policy, plan.broadcast, world_size, groups.control, groups.stages,
                            persistent_alloc(memory),
                            header_words=WORDS_PER_RANK * world_size if balance.planning else 0)
    if plan.learner:  # after agreeing on (or resuming) the whole state, and copying it
        prepare_learner(cfg, model.algo, groups, memory)
    if memory is not None:
        memory.persistent.seal()  # from here on, only the transient pool allocates
    source, sink, expected = build_data_plane(plan.chunks, data_plane or cfg.data_plane, rank, sl.queue_size,
                                              limits=chunk_spec.message_limits(), fields=chunk_spec.optional_fields())
    # One order of collectives on a learner of several (swimlane/agreement/ordering.py).
    order = CollectiveOrder(enabled=plan.learner and sl.learner_ranks > 1,
                            start=resumed.version if resumed is not None else 0,
                            every=sl.broadcast_every, last=cfg.run.iterations, poll_s=poll_s)
    return RankParts(plan, device, topology, placement, memory, host_pool, streams, groups, model.envs,
                     model.policy, model.algo, model.sample_gen, model.learn_gen, chunk_spec, checkpoints, resumed,
                     balance, buffers.weights, buffers.snapshot, buffers.snap_flats, buffers.bc, source, sink,
                     expected, order)


def _resume(cfg: JobConfig, checkpoints: RunCheckpoints, rank: int, restarts: int, groups: Groups,
            placement: Placement, device: torch.device) -> Resumed | None:
    """The learner's starting state: the newest checkpoint (``run.resume``, or when torchrun
    restarted this worker group), which several learners agree on (rank 0's:
    :mod:`swimlane.agreement.start`); None to start fresh."""
    got = resume_learner(checkpoints, resume=cfg.run.resume or restarts > 0, restarts=restarts, rank=rank,
                         learner_ranks=cfg.swimlane.learner_ranks, agree_on=lambda got, error: agree(
                             checkpoints, got, group=groups.learner, learners=placement.learners, rank=rank,
                             device=device, error=error))
    if got is not None and rank == 0:
        (log.warning if restarts else log.info)("resumed from %s (version %d, restart %d)", got.path,
                                                got.version, restarts)
        truncate_metrics(Path(cfg.run.out_dir) / "metrics.jsonl", got.version)
    return got


def restarts_from_env() -> int:
    """How often torchrun restarted this worker group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def as_built(parts: RankParts, lanes: list[str]) -> RankPlan:
    """The rank's plan as read back from what was built and started (``lanes``): its lanes,
    its end of the broadcast and its buffers, its chunk routes and senders, its process
    groups, pools and streams; what nothing built records (host, role, gradient averaging,
    checkpoints) is the plan's. The summary writes it as ``--print-rank`` does, so that a test
    can hold what a rank ran against what it printed."""
    import dataclasses

    import torch.distributed as dist

    from swimlane.lanes.chunks import LocalChunks, RemoteChunkSink, RoutedSink

    plan, bc, weights, snapshot = parts.plan, parts.bc, parts.weights, parts.snapshot
    held = weights.replicas[0] if weights is not None else snapshot
    dtype = next((p.dtype for p in held.parameters() if p.is_floating_point()), torch.float32) if held is not None \
        else (bc.buckets[0].flat.dtype if bc is not None and bc.buckets else torch.float32)
    source = bc.receives_from if bc is not None and bc.receives_from is not None else plan.rank if bc else 0
    buffers = "+".join(b for b, there in (("replicas", weights is not None), ("snapshot", snapshot is not None))
                       if there) or "relay"
    role = "source" if source == plan.rank or bc is None else "receive" if weights is not None else "relay"
    broadcast = Broadcast(role, 0 if role == "source" else source, buffers, "bf16" if dtype == torch.bfloat16 else "fp32")

    sink = parts.sink
    sinks = sink.sinks if isinstance(sink, RoutedSink) else {sink.learner: sink} if isinstance(sink, RemoteChunkSink) \
        else {}
    chunks = Chunks(local=isinstance(parts.source, LocalChunks),
                    routes=tuple(Route(lr, s.sender.address.split("://")[0]) for lr, s in sinks.items()),
                    first=sink.learner if sinks else None,
                    senders=tuple(int(s.removeprefix("rank")) for s in parts.expected_senders),
                    senders_elsewhere=plan.chunks.senders_elsewhere)
    groups = None
    if parts.groups.control is not None:
        groups = PlannedGroups(parts.groups.learners(),
                               str(dist.get_backend(parts.groups.control)),
                               plan.groups.stages if parts.groups.stages is not None else None)
    memory, host = parts.memory, parts.host_pool
    pools = Pools() if memory is None else Pools(
        persistent=memory.persistent.device.type, transient=memory.transient.device.type,
        host=None if host is memory.transient else "cpu, pinned" if host.pin_memory else "cpu")
    streams = tuple(Stream(lane, s.high_priority) for lane, s in parts.streams.items() if s.stream is not None)
    return dataclasses.replace(plan, lanes=tuple(lanes), broadcast=broadcast, chunks=chunks, groups=groups,
                               pools=pools, streams=streams, env_groups=len(parts.envs),
                               envs_per_group=parts.envs[0].n_envs if parts.envs else 0)
