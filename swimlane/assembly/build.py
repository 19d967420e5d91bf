"""What a rank builds before its lanes start: its place in the cluster, its memory pools,
its process groups, its env groups, policy and algorithm and the normalisation they act
with, its weight buffers (double-buffered replicas, snapshot, broadcaster) and its ends of
the data plane.
Functions of the config and the rank's plan (:mod:`swimlane.assembly.plan`);
:func:`swimlane.assembly.parts.assemble` calls them in order."""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from dvla.algos import build_algorithm
from dvla.config import ConfigError, JobConfig, SwimlaneConfig
from memory.config import MemoryConfig
from dvla.distributed import allreduce_mean_grads, broadcast_json
from dvla.envs import env_spec, make_env
from dvla.state.init_weights import check_normalization, load_init, resumed_normalization
from dvla.normalize import Normalizer
from dvla.policy import ExtraSpec, PolicySpec, build_policy
from dvla.rollout import cameras_of
from dvla.distributed.sharding import checkpoint_activations, shard_learner
from launch.placement import Placement, format_placement, place
from launch.topology import Topology, describe, discover, from_spec, local_topology
from memory import BudgetError, MemoryManager, TransientPool, parse_budget
from planes.addresses import AddressError
from planes.buckets import flat_buckets, frozen_names, layout_copy, meta_alloc
from planes.config import DataPlaneConfigError
from planes.keys import load_client_keys
from planes.control import WeightBroadcaster, hierarchical_stages, new_control_group
from planes.serial import DTYPES as SERIAL_DTYPES
from planes.data import (
    DataPlaneConfig,
    TrajectoryReceiver,
    TrajectorySender,
    lookup_endpoints,
)
from swimlane.assembly.plan import Broadcast, Chunks, Groups as PlannedGroups, Pools, RankPlan, Route, Stream
from swimlane.lanes.streams import LaneStream
from swimlane.lanes.chunks import LocalChunks, RemoteChunkSink, RemoteChunkSource, RoutedSink
from swimlane.lanes.weights import DoubleBufferedWeights

log = logging.getLogger("dvla.swimlane")


def check_world(sl: SwimlaneConfig, world: int) -> None:
    """What the swimlane config asks of the number of processes."""
    if sl.learner_ranks > world:
        raise ConfigError(f"swimlane.learner_ranks: {sl.learner_ranks} learner ranks need at least that "
                          f"many processes, the world has {world}")
    if not sl.colocate and sl.learner_ranks == world:
        raise ConfigError("swimlane.colocate: false leaves no rank to run rollouts; add processes or "
                          "lower swimlane.learner_ranks")
    if sl.driver == "serial" and world > 1:
        raise ConfigError(f"swimlane.driver: serial runs one process, the world has {world}; "
                          f"use swimlane.driver=threads")


def place_ranks(sl: SwimlaneConfig, rank: int, world: int) -> tuple[Topology, Placement]:
    """Hosts of all ranks (given or discovered), then roles, routes and broadcast tree."""
    if sl.topology:
        try:
            topo = from_spec(sl.topology)
        except ValueError as exc:
            raise ConfigError(f"swimlane.topology: {exc}") from None
        if topo.world_size != world:
            raise ConfigError(f"swimlane.topology: {sl.topology!r} describes {topo.world_size} ranks, "
                              f"the world has {world}")
    elif world == 1:
        topo = local_topology()
    else:
        topo = discover(dist.distributed_c10d._get_default_store(), rank, world,
                        local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    try:
        placement = place(topo, sl.learner_ranks, sl.colocate)
    except ValueError as exc:
        raise ConfigError(f"swimlane.learner_ranks: {exc}") from None
    if placement.source != 0:
        raise ConfigError(f"swimlane: rank 0 must be the first learner (placement chose {placement.source})")
    if world > 1 and rank == 0:
        log.info("topology: %s", describe(topo))
        log.info("placement:\n%s", format_placement(placement, topo))
    return topo, placement


def build_memory(pools: Pools, cfg: MemoryConfig, device: torch.device) -> tuple[MemoryManager | None,
                                                                             TransientPool | None]:
    """The pools the plan names (none with ``memory.enabled=false``) and the pool rollout
    buffers come from: the transient pool, or host memory of its own where the plan says so
    (pinned on a CUDA run, so that :class:`dvla.rollout.EpisodeRecorder` copies into it
    without waiting), since the buffers go to the data plane from there."""
    if pools.persistent is None:
        return None, None
    try:  # checked at config time on the CPU; a fraction resolves per device here
        memory = MemoryManager(device, cfg.persistent_budget, cfg.transient_budget)
        host_pool = memory.transient
        if pools.host is not None:
            host_pool = TransientPool("cpu", parse_budget(cfg.transient_budget, "cpu", "memory.transient_budget"),
                                      name="transient_host", pin_memory="pinned" in pools.host)
    except BudgetError as exc:
        raise ConfigError(str(exc)) from None
    return memory, host_pool


def build_streams(streams: tuple[Stream, ...], device: torch.device) -> dict[str, LaneStream]:
    """A :class:`LaneStream` for the inference and the gradient lane: a CUDA stream of its own
    where the plan names one, else the current stream."""
    planned = {s.lane: s for s in streams}
    return {lane: LaneStream(device, lane in planned, high_priority=lane in planned and planned[lane].high_priority)
            for lane in ("inference", "gradient")}


def memory_metrics(memory: MemoryManager | None, host_pool: TransientPool | None) -> dict[str, float]:
    """Both pools' metrics, and the host pool's where rollouts have one of their own."""
    if memory is None:
        return {}
    m = memory.metrics()
    if host_pool is not memory.transient:
        m.update(host_pool.stats().as_metrics())
    return m


def persistent_alloc(memory: MemoryManager | None) -> Callable[..., torch.Tensor] | None:
    """An allocator for flat weight buckets from the persistent pool (None: plain tensors)."""
    if memory is None:
        return None

    def alloc(numel: int, dtype: torch.dtype, device: torch.device, tag: str) -> torch.Tensor:
        return memory.persistent.empty((numel,), dtype, tag=tag)

    return alloc


@dataclass
class Groups:
    learner: Any = None  # the learners' gradient all-reduce (None in one process)
    control: Any = None  # the control plane's broadcast group
    stages: Any = None  # the hierarchical broadcast's stages (None: flat)
    learner_ranks: tuple[int, ...] = ()  # the ranks the learners' group was created with

    def learners(self) -> tuple[int, ...]:
        """The learners' group's ranks: as torch holds them on a member; on any other rank
        (which holds no handle of it, only torch's non-member marker), as it was created."""
        if self.learner is None or self.learner is dist.GroupMember.NON_GROUP_MEMBER:
            return self.learner_ranks
        return tuple(dist.get_process_group_ranks(self.learner))


def build_groups(plan: PlannedGroups | None, timeout_s: float, device: torch.device) -> Groups:
    """The process groups the plan names, created by every rank in the same order: the
    learners' (it takes the default group's backends: on CUDA both, CPU tensors go over gloo),
    the control plane's and the staged broadcast's (the plan's backend: NCCL for weights on
    CUDA, gloo on the CPU)."""
    if plan is None:
        return Groups()
    timeout = timedelta(seconds=timeout_s)  # the default group's, from the config too
    learner = dist.new_group(list(plan.learners), timeout=timeout)
    control = new_control_group(device=device, timeout=timeout, backend=plan.backend)
    stages = None
    if plan.stages is not None:
        s = plan.stages
        stages = hierarchical_stages(list(s.leaders), [list(g) for g in s.local_groups], s.source,
                                     backend=plan.backend, timeout=timeout)
    return Groups(learner, control, stages, tuple(plan.learners))


@dataclass
class Model:
    envs: list  # this rank's env groups (none on a learner-only rank)
    policy: torch.nn.Module
    algo: Any  # learners only
    sample_gen: torch.Generator  # actions
    learn_gen: torch.Generator | None  # minibatches (learners)


def check_policy_io(policy, name: str) -> None:
    """What the policy reads and records must be able to travel: cameras the env has, and
    rollout extras the data plane can carry (a ConfigError naming the problem otherwise)."""
    try:
        cameras_of(policy)
    except ValueError as exc:  # the policy reads a camera the env does not have
        raise ConfigError(f"policy.name={name}: {exc}") from None
    for key, spec in policy.rollout_extras().items():
        where = f"policy.name={name}: rollout_extras()[{key!r}]"
        if not isinstance(spec, ExtraSpec):
            raise ConfigError(f"{where}: expected an ExtraSpec(shape, dtype, high), got {spec!r}")
        if spec.dtype not in SERIAL_DTYPES.values():
            raise ConfigError(f"{where}: dtype {spec.dtype} cannot travel on the data plane "
                              f"(allowed: {', '.join(SERIAL_DTYPES)})")
        if not all(isinstance(n, int) and n > 0 for n in spec.shape):
            raise ConfigError(f"{where}: shape {spec.shape} must be positive integers")


def build_model(cfg: JobConfig, plan: RankPlan, device: torch.device, groups: Groups,
                memory: MemoryManager | None) -> Model:
    """Env groups, policy and (on learners) the algorithm, as ``plan`` says, seeded so that
    every driver and every rank of a role builds the same weights; rank 0's are then
    ``policy.init``'s where it is set (before the algorithm copies its KL reference)."""
    seed, rank = cfg.run.seed, plan.rank
    torch.manual_seed(seed)
    envs = []
    env_cfg = cfg.env.for_rank(rank)
    if plan.rollout:
        envs = [make_env(env_cfg, device, seed=seed + 7919 * rank)]
        spec_ = envs[0].spec
    else:  # a learner-only rank needs the spec, not a simulator (where the env can tell)
        spec_ = env_spec(cfg.env, device, seed=seed + 7919 * rank)
    spec = PolicySpec.for_env(spec_, cfg.policy.action_chunk)
    policy = build_policy(cfg.policy.name, spec, cfg.policy.options, cfg.policy.temperature).to(device).eval()
    check_policy_io(policy, cfg.policy.name)
    if cfg.policy.init and rank == 0 and not cfg.run.resume:  # before the KL reference is copied (the algorithm)
        # Others get rank 0's weights (agreement, v0) and normalisation (share_normalization).
        log.info("%s", load_init(policy, cfg.policy.init, cfg.policy.name))
    envs += [make_env(env_cfg, device, seed=seed + 7919 * rank + 15485863 * g) for g in range(1, plan.env_groups)]
    algo = learn_gen = None
    if plan.learner:
        sync = None  # FSDP reduce-scatters its own gradients (dvla.distributed.sharding)
        if plan.grad_sync in ("mean", "masked_mean"):
            # Adaptive roles: a learner that sits an update out is left out of the mean.
            sync = partial(allreduce_mean_grads, group=groups.learner, masked=plan.grad_sync == "masked_mean")
        pooled = memory is not None and plan.grad_sync != "fsdp"  # FSDP allocates a sharded learner's own
        if pooled:  # the learner's weights live in persistent buckets
            flat_buckets(policy, alloc=persistent_alloc(memory), tag="policy")
        # Replicas in another precision than the learner's: every step's proximal log-prob is
        # recomputed, so the clipped ratio is 1 at unchanged weights (dvla/algos/base.py).
        behaviour = torch.bfloat16 if plan.broadcast.dtype == "bf16" else torch.float32
        algo = build_algorithm(cfg.algo, policy, sync, behaviour_dtype=behaviour, horizon=cfg.run.iterations,
                               group=groups.learner if sync is not None else None)
        if pooled:
            memory.persistent.adopt_optimizer(algo.optimizer)
        learn_gen = torch.Generator().manual_seed(seed + 2)
    sample_gen = torch.Generator(device=device).manual_seed(seed + 104729 * rank + 1)
    return Model(envs, policy, algo, sample_gen, learn_gen)


def share_normalization(cfg: JobConfig, model: Model, rank: int, world: int, resumed=None) -> Normalizer | None:
    """The normalisation (:mod:`dvla.normalize`) the run acts with, installed on every rank
    before its replicas are copied: rank 0 resolves it (a fresh run: what ``policy.init``
    brought, :func:`build_model`; a resume: what its checkpoint records,
    :func:`dvla.state.init_weights.resumed_normalization`) and sends it to every rank as JSON over
    the default group (another host need not see rank 0's files). Every rank installs it on
    its policy and the KL reference, so that its replicas (copies of the policy) act with it;
    a resume whose record is damaged stops every rank with rank 0's one-line error. Run by
    every rank, after the learners resumed and agreed (:func:`swimlane.assembly.parts.assemble`)."""
    text = error = None
    if rank == 0:
        try:
            norm = getattr(model.policy, "normalizer", None)
            if resumed is not None:
                norm = resumed_normalization(resumed.manifest, resumed.path, Path(cfg.run.out_dir))
            check_normalization(norm, model.policy, f"run.resume: {resumed.path}" if resumed is not None
                                else f"policy.init: {cfg.policy.init}")
            text = norm.to_json() if norm is not None else None
        except ConfigError as exc:
            error = str(exc)
    if world > 1:  # (every rank, so none waits for the others when rank 0 cannot go on)
        text, error = broadcast_json([text, error], src=0)
    if error is not None:
        raise ConfigError(error)
    norm = Normalizer.from_json(text) if text is not None else None  # one value, exactly, on every rank
    for module in (model.policy, getattr(model.algo, "reference", None)):
        if module is not None:
            module.normalizer = norm
    if rank == 0 and norm is not None and (resumed is not None or world > 1):
        log.info("normalisation %s (%s) on every rank", norm.digest(),
                 f"from {resumed.path}" if resumed is not None else f"policy.init={cfg.policy.init}")
    return norm


def prepare_learner(cfg: JobConfig, algo, groups: Groups, memory: MemoryManager | None) -> None:
    """What a learner becomes once its starting state is agreed and its replicas are copied:
    activation checkpointing (``algo.activation_checkpointing``), then FSDP2 shards
    (``algo.shard``; ``auto``: with several learners), the moments' shards adopted by the
    persistent pool (FSDP keeps the weights')."""
    if cfg.algo.activation_checkpointing:
        try:
            checkpoint_activations(algo.policy)
        except ValueError as exc:
            raise ConfigError(f"policy.name={cfg.policy.name}: {exc}") from None
    if cfg.sharded_learners:
        shard_learner(algo, groups.learner)
        if memory is not None:
            memory.persistent.adopt_optimizer(algo.optimizer)


@dataclass
class WeightBuffers:
    weights: DoubleBufferedWeights | None  # the inference lane's two replicas (None: the rank does not roll out)
    snapshot: Any  # rank 0: the copy the broadcast lane sends from (None elsewhere)
    snap_flats: list[torch.Tensor] | None
    bc: WeightBroadcaster | None  # the control plane (None in one process)


def build_weights(policy, plan: Broadcast, world: int, control_group, stages, alloc,
                  header_words: int = 0) -> WeightBuffers:
    """The weight buffers ``plan.buffers`` names, all laid out in flat buckets (from the
    persistent pool when memory is managed), their floating-point tensors in the publish
    dtype: inference replicas (double-buffered) on a rank that rolls out, the learner's
    snapshot on rank 0, and the broadcaster. The policy's frozen parameters go over the
    control plane with the first version only. A rank other than 0 that does not roll out
    (``relay``) holds the layout only and relays each version bucket by bucket
    (:meth:`WeightBroadcaster.relay_buckets`). ``header_words``: what travels with each
    version number (the rebalancing plan)."""
    dtype = torch.bfloat16 if plan.dtype == "bf16" else torch.float32
    bcast = partial(WeightBroadcaster, src=0, group=control_group, stages=stages, frozen=frozen_names(policy),
                    header_words=header_words)

    def copy_of(model):
        return copy.deepcopy(model).requires_grad_(False).to(dtype)

    if plan.buffers == "relay":  # the layout only, on the meta device
        bc = bcast(layout_copy(policy, dtype), alloc=meta_alloc, device=next(policy.parameters()).device)
        return WeightBuffers(None, None, None, bc)
    if plan.buffers == "snapshot":
        snapshot = copy_of(policy)
        bc = bcast(snapshot, alloc=alloc)
        return WeightBuffers(None, snapshot, [b.flat for b in bc.buckets], bc)
    replicas = [copy_of(policy) for _ in range(2)]
    if world == 1:
        snapshot = copy_of(policy)
        snap_flats = flat_buckets(snapshot, alloc=alloc, tag="snapshot")
        flats = [flat_buckets(r, alloc=alloc, tag=f"replica{i}") for i, r in enumerate(replicas)]
        return WeightBuffers(DoubleBufferedWeights(replicas, flats), snapshot, snap_flats, None)
    if plan.buffers == "replicas+snapshot":
        snapshot = copy_of(policy)
        bc = bcast(snapshot, alloc=alloc)
        flats = [bc.bind_replica(r, tag=f"replica{i}") for i, r in enumerate(replicas)]
        return WeightBuffers(DoubleBufferedWeights(replicas, flats), snapshot, [b.flat for b in bc.buckets], bc)
    bc = bcast(replicas[0], alloc=alloc)
    flats = [[b.flat for b in bc.buckets], bc.bind_replica(replicas[1], tag="replica1")]
    return WeightBuffers(DoubleBufferedWeights(replicas, flats), None, None, bc)


def build_data_plane(plan: Chunks, dp: DataPlaneConfig, rank: int, queue_size: int,
                     limits: tuple[int, int] | None = None, fields: dict | None = None):
    """``(source, sink, expected_senders)`` as the plan says: a local queue in one process;
    otherwise a learner binds a receiver (its tcp endpoint where its senders on other hosts
    can reach it) and a rollout rank has a sender per route, over the route's transport. With
    several routes (adaptive roles) a :class:`swimlane.lanes.chunks.RoutedSink` picks one per
    chunk, the plan's first at the start. ``limits``: the largest legal message and frame of
    this job (:meth:`swimlane.lanes.validate.ChunkSpec.message_limits`); the receiver refuses
    bigger ones (never above what ``dp`` allows). ``fields``: the further tensors every chunk
    carries (:meth:`swimlane.lanes.validate.ChunkSpec.optional_fields`)."""
    if plan.local:
        chunks = LocalChunks(queue_size)
        return chunks, chunks, []
    store = dist.distributed_c10d._get_default_store()
    source = sink = None
    expected: list[str] = []
    if plan.senders:
        bounds = {}
        if limits is not None:
            bounds = {"max_message_bytes": min(dp.max_message_bytes, limits[0]),
                      "max_frame_bytes": min(dp.max_frame_bytes or dp.max_message_bytes, limits[1])}
        dp_cfg = DataPlaneConfig(**{**dp.__dict__, "recv_queue": queue_size, **bounds})
        expected = [f"rank{r}" for r in plan.senders]
        try:  # only the plan's senders may own records here
            receiver = TrajectoryReceiver(dp_cfg, store=store, key=f"dvla/data/{rank}",
                                          peers_elsewhere=plan.senders_elsewhere,
                                          rendezvous=os.environ.get("MASTER_ADDR"), senders=expected)
        except (AddressError, DataPlaneConfigError) as exc:
            raise ConfigError(str(exc)) from None
        source = RemoteChunkSource(receiver, fields)
    if plan.routes:
        keys = None
        if dp.curve and dp.curve_keys_dir:
            try:
                keys = load_client_keys(dp.curve_keys_dir, f"rank{rank}")
            except DataPlaneConfigError as exc:
                raise ConfigError(str(exc)) from None

        def sink_to(route: Route) -> RemoteChunkSink:
            endpoints = lookup_endpoints(store, key=f"dvla/data/{route.learner}")
            dp_cfg = DataPlaneConfig(**{**dp.__dict__, "transport": route.transport})
            return RemoteChunkSink(TrajectorySender(endpoints, dp_cfg, sender_id=f"rank{rank}", client_keys=keys),
                                   route.learner)

        sinks = {route.learner: sink_to(route) for route in plan.routes}
        sink = RoutedSink(sinks, plan.first) if len(sinks) > 1 else sinks[plan.first]
    return source, sink, expected
