"""What one rank is made of, as a pure plan: computed from the job config, the rank's place
in the cluster (:mod:`launch.placement`) and its device, before anything is built.

:func:`plan_rank` decides, in one place, every part a rank has for its role: its lanes, its
env groups, its weight buffers, its process groups and how gradients are averaged, its
channels (in-process queues and data-plane routes), its memory pools and its CUDA streams.
:func:`swimlane.assemble.assemble` turns a plan into parts in one straight pass, and the
runner starts exactly the lanes the plan names. ``python -m dvla.launch --print-rank``
prints the plans of a job's ranks without building anything (:func:`format_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from launch.placement import Placement
from launch.topology import Topology
from memory import runtime

# What each lane does, by the name RankLanes gives it.
LANE_ROLES = {
    "sampling": "steps the env groups, sends chunks",
    "inference": "batched forward passes on the newest replica",
    "gradient": "learner updates, snapshot handoff",
    "broadcast": "publishes each version (control plane source)",
    "receive": "receives each version into the standby replica",
    "relay": "forwards each version bucket by bucket (holds no replica)",
}


@dataclass(frozen=True)
class Channel:
    """One way data moves between lanes or ranks: ``kind`` is ``local`` (an in-process
    queue), ``ipc``/``tcp`` (the data plane) or ``control`` (the weights' process group)."""

    name: str
    src: str
    dst: str
    kind: str


@dataclass(frozen=True)
class RankPlan:
    rank: int
    world_size: int
    host: str
    role: str  # "learner+rollout", "learner" or "rollout" (one process: "learner+rollout")
    device: str
    learner: bool
    rollout: bool
    lanes: tuple[str, ...]  # in start order; "broadcast" (rank 0), "receive" or "relay" for the weights
    env_groups: int = 0  # built on this rank (the stepping ones and the spares)
    env_groups_stepping: int = 0
    envs_per_group: int = 0
    weights: str = "none"  # "replicas" (two, double-buffered), "snapshot", "replicas+snapshot", "relay"
    publish_dtype: str = "fp32"
    grad_sync: str = "none"  # "none", "mean", "masked_mean" (adaptive roles) or "fsdp"
    process_groups: tuple[str, ...] = ()
    channels: tuple[Channel, ...] = ()
    pools: tuple[str, ...] = ()
    streams: tuple[str, ...] = ()
    checkpoints: str = "none"  # "write" (rank 0), "gather" (a sharded learner), "none"
    notes: tuple[str, ...] = field(default=())

    @property
    def chunks_to(self) -> int | None:
        """The learner this rank's chunks go to first (None: it samples nothing)."""
        for c in self.channels:
            if c.name == "chunks" and c.src == f"rank{self.rank}":
                return int(c.dst.removeprefix("rank"))
        return None

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["channels"] = [c.__dict__ for c in self.channels]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _dtype_name(cfg, device: torch.device) -> str:
    name = cfg.swimlane.publish_dtype
    return name if name != "auto" else ("bf16" if device.type == "cuda" else "fp32")


def plan_rank(cfg, rank: int, topology: Topology, placement: Placement,
              device: torch.device | str = "cpu") -> RankPlan:
    """The plan of ``rank`` in a job of ``cfg`` placed by ``placement`` on ``topology``
    (no process group, env or model is built: a pure function of its arguments)."""
    from swimlane.roles import initial_routes

    sl, device = cfg.swimlane, torch.device(device)
    world = placement.world_size
    learner, rollout = rank in placement.learners, rank in placement.rollout
    lanes: list[str] = ["gradient"] if learner else []
    if rank == 0:
        lanes.append("broadcast")
    else:
        lanes.append("receive" if rollout else "relay")
    if rollout:
        lanes += ["inference", "sampling"]

    if world == 1:
        weights = "replicas+snapshot"
    elif rank == 0:
        weights = "replicas+snapshot" if rollout else "snapshot"
    else:
        weights = "replicas" if rollout else "relay"

    grad_sync = "none"
    if learner and sl.learner_ranks > 1:
        grad_sync = "fsdp" if cfg.sharded_learners else "masked_mean" if sl.roles == "adaptive" else "mean"

    groups: list[str] = []
    channels: list[Channel] = []
    me = f"rank{rank}"
    if rollout:
        channels += [Channel("requests", "sampling", "inference", "local"),
                     Channel("replies", "inference", "sampling", "local")]
    if learner and rank == 0:
        channels.append(Channel("snapshot", "gradient", "broadcast", "local"))
    if world == 1:
        channels.append(Channel("chunks", "sampling", "gradient", "local"))
    else:
        backend = "nccl" if device.type == "cuda" and sl.collective_backend == "auto" else "gloo"
        groups += [f"learners {placement.learners}", f"control ({backend}, all ranks)"]
        if sl.hierarchical_broadcast and len(placement.tree.leaders) > 1:
            groups.append(f"broadcast stages (leaders {placement.tree.leaders})")
        routes = initial_routes(sl, placement)
        if rollout:
            dst = routes[rank]
            same = topology.same_host(dst, rank)
            auto = placement.transports[rank] if dst == placement.routes[rank] else "ipc" if same else "tcp"
            kind = cfg.data_plane.transport if cfg.data_plane.transport != "auto" else auto
            channels.append(Channel("chunks", me, f"rank{dst}", kind))
        if learner:
            senders = placement.rollout if sl.roles == "adaptive" else placement.senders_of(rank)
            for r in senders:
                if r != rank or sl.roles == "adaptive":
                    channels.append(Channel("chunks", f"rank{r}", me, "data plane"))
        tree = placement.tree
        staged = sl.hierarchical_broadcast and len(tree.leaders) > 1
        src = tree.leader_of(rank) if staged and tree.stage_of(rank) == "member" else 0
        if rank == 0:
            channels.append(Channel("weights", me, "all ranks", "control"))
        else:
            channels.append(Channel("weights", f"rank{src}", me, "control"))

    pools: list[str] = []
    if cfg.memory.enabled:
        pools = [f"persistent ({device.type})"]
        if learner or rollout:
            pools.append(f"transient ({device.type})")
        if device.type != "cpu" and rollout:
            pools.append("transient_host (cpu, pinned)" if device.type == "cuda" else "transient_host (cpu)")
    streams: tuple[str, ...] = ()
    if device.type == "cuda" and sl.cuda_streams:
        streams = tuple(s for s, on in (("inference (high priority)", rollout), ("gradient", learner)) if on)

    checkpoints = "none"
    if learner:
        checkpoints = "write" if rank == 0 else "gather" if cfg.sharded_learners else "resume only"
    notes = []
    if sl.roles == "adaptive" and learner and rank != 0:
        notes.append("candidate learner: samples until the role plan makes it learn")
    built = sl.env_groups + sl.spare_groups if rollout else 0
    return RankPlan(
        rank=rank, world_size=world, host=topology.hosts[topology.host_of(rank)].name,
        role=placement.role(rank), device=str(device), learner=learner, rollout=rollout, lanes=tuple(lanes),
        env_groups=built, env_groups_stepping=(sl.autotune_start_groups or sl.env_groups) if rollout else 0,
        envs_per_group=cfg.env.n_envs if rollout else 0, weights=weights, publish_dtype=_dtype_name(cfg, device),
        grad_sync=grad_sync, process_groups=tuple(groups), channels=tuple(channels), pools=tuple(pools),
        streams=streams, checkpoints=checkpoints, notes=tuple(notes))


def format_plan(plan: RankPlan) -> str:
    """The plan as a short block of text (``--print-rank``)."""
    lines = [f"rank {plan.rank} of {plan.world_size} on {plan.host}: {plan.role}, device {plan.device}"]
    lines.append("  lanes:    " + "; ".join(f"{lane} ({LANE_ROLES[lane]})" for lane in plan.lanes))
    if plan.rollout:
        spare = plan.env_groups - plan.env_groups_stepping
        lines.append(f"  envs:     {plan.env_groups_stepping} group(s) stepping of {plan.envs_per_group} envs"
                     + (f", {spare} spare" if spare else ""))
    lines.append(f"  weights:  {plan.weights} ({plan.publish_dtype})")
    if plan.learner:
        lines.append(f"  learning: gradients {plan.grad_sync}, checkpoints {plan.checkpoints}")
    if plan.process_groups:
        lines.append("  groups:   " + "; ".join(plan.process_groups))
    for c in plan.channels:
        lines.append(f"  channel:  {c.name:<9} {c.src} -> {c.dst} ({c.kind})")
    lines.append("  pools:    " + ("; ".join(plan.pools) if plan.pools else "none (plain allocation)"))
    if plan.streams:
        lines.append("  streams:  " + "; ".join(plan.streams))
    lines += [f"  note:     {n}" for n in plan.notes]
    return "\n".join(lines)


def plans_for(cfg, world_size: int = 1) -> list[RankPlan]:
    """Every rank's plan for a job of ``world_size`` processes, without starting one: on the
    topology ``swimlane.topology`` gives, else on one host. On CUDA each rank is planned on
    its own GPU, which it sees alone (as ``cuda:0``). A ValueError names what does not fit."""
    from launch.placement import place
    from launch.topology import from_spec, local_topology

    sl = cfg.swimlane
    topology = (from_spec(sl.topology) if sl.topology else local_topology() if world_size == 1
                else from_spec([world_size]))
    placement = place(topology, sl.learner_ranks, sl.colocate)
    available = runtime.current().available()
    device = torch.device("cpu" if cfg.run.device == "auto" and not available
                          else "cuda:0" if cfg.run.device in ("auto", "cuda") else cfg.run.device)
    # Every rank sees its own GPU alone, as cuda:0 (memory.runtime.visible_device_env).
    return [plan_rank(cfg, rank, topology, placement, device) for rank in range(topology.world_size)]
