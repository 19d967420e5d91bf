"""What one rank is made of, decided once: a pure plan computed from the job config, the rank's
place in the cluster (:mod:`launch.placement`) and its device, before anything is built.

:func:`plan_rank` makes every decision a rank's role implies, as typed objects the builders
take as they are (:mod:`swimlane.assembly.build`; none of them decides anything again): its
lanes and its end of the weights' broadcast (:class:`Broadcast`), its env groups, how its
gradients are averaged, the process groups it creates (:class:`Groups`), how its chunks travel
(:class:`Chunks`, :class:`Route`), its memory pools (:class:`Pools`) and its CUDA streams
(:class:`Stream`). ``python -m dvla.launch --print-rank`` prints the plans of a job's ranks
without building anything (:func:`format_plan`); a running rank writes the same text, read
back from what it built (:func:`swimlane.assembly.parts.as_built`), into its summary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dvla.config import ConfigError
from launch.placement import Placement
from launch.topology import Topology
from memory import runtime
from planes.zap import KEYS_FIX

LANES = ("gradient", "broadcast", "inference", "sampling")  # in start order
LANE_ROLES = {  # what each lane does on a rank
    "sampling": "steps the env groups, sends chunks",
    "inference": "batched forward passes on the newest replica",
    "gradient": "learner updates, snapshot handoff",
    "broadcast": "weights versions: {}",
}
BROADCAST_ROLES = {
    "source": "publishes each version (control plane source)",
    "receive": "receives each version into the standby replica",
    "relay": "forwards each version bucket by bucket (holds no replica)",
}


@dataclass(frozen=True)
class Broadcast:
    """The rank's end of the weights' broadcast."""

    role: str  # "source" (rank 0), "receive" (into its standby replica) or "relay" (holds no replica)
    source: int  # the rank it receives from: 0, or its host's leader in a staged broadcast (its own rank: source)
    buffers: str  # "replicas" (two, double-buffered), "snapshot", "replicas+snapshot" or "relay" (the layout only)
    dtype: str  # of the published weights: "fp32" or "bf16"


@dataclass(frozen=True)
class Route:
    """Where a rollout rank's chunks may go: a learner, over a transport."""

    learner: int
    transport: str  # "ipc" or "tcp"


@dataclass(frozen=True)
class Chunks:
    """How trajectory chunks travel at this rank."""

    local: bool = False  # one process: an in-process queue between its sampling and gradient lanes
    routes: tuple[Route, ...] = ()  # a rollout rank: a sender per learner it may send to (all, with adaptive roles)
    first: int | None = None  # ... the learner its chunks go to at the start
    senders: tuple[int, ...] = ()  # a learner: the rollout ranks it receives from
    senders_elsewhere: bool = False  # ... some of them on other hosts (its tcp endpoint must reach them)


@dataclass(frozen=True)
class Stages:
    """The staged broadcast: the source to one leader per host, each leader to its host."""

    source: int
    leaders: tuple[int, ...]
    local_groups: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Groups:
    """The process groups of a job of several processes (every rank creates every one, in
    this order): the learners' (gradients, metrics; the default group's backends), the control
    plane's (weights) and the staged broadcast's."""

    learners: tuple[int, ...]
    backend: str  # the control plane's: "nccl" (weights on CUDA) or "gloo"
    stages: Stages | None = None


@dataclass(frozen=True)
class Pools:
    """The memory pools (none with ``memory.enabled=false``): by device type."""

    persistent: str | None = None
    transient: str | None = None  # (the gradient and inference lanes' activations and batches)
    host: str | None = None  # rollout buffers, where not the transient pool: "cpu, pinned" (on a GPU)


@dataclass(frozen=True)
class Stream:
    """A lane's CUDA stream (``swimlane.cuda_streams``)."""

    lane: str
    high_priority: bool = False


@dataclass(frozen=True)
class RankPlan:
    rank: int
    world_size: int
    host: str
    role: str  # "learner+rollout", "learner" or "rollout" (one process: "learner+rollout")
    device: str
    learner: bool
    rollout: bool
    lanes: tuple[str, ...]  # of LANES, in start order
    broadcast: Broadcast
    chunks: Chunks
    routes: dict[int, int] = field(default_factory=dict)  # every rollout rank -> its learner at the start
    env_groups: int = 0  # built on this rank (the stepping ones and the spares)
    env_groups_stepping: int = 0
    envs_per_group: int = 0
    grad_sync: str = "none"  # "none", "mean", "masked_mean" (adaptive roles) or "fsdp"
    groups: Groups | None = None  # None: one process
    pools: Pools = Pools()
    streams: tuple[Stream, ...] = ()
    checkpoints: str = "none"  # "write" (rank 0), "gather" (a sharded learner), "resume only", "none"
    notes: tuple[str, ...] = ()

    @property
    def chunks_to(self) -> int | None:
        """The learner this rank's chunks go to first (None: it samples nothing)."""
        return self.rank if self.chunks.local else self.chunks.first

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["routes"] = {str(k): v for k, v in self.routes.items()}
        return d


def _dtype_name(cfg, device: torch.device) -> str:
    name = cfg.swimlane.publish_dtype
    return name if name != "auto" else ("bf16" if device.type == "cuda" else "fp32")


def _broadcast(rank: int, world: int, rollout: bool, placement: Placement, staged: bool, dtype: str) -> Broadcast:
    tree = placement.tree
    if world == 1:
        return Broadcast("source", 0, "replicas+snapshot", dtype)
    if rank == 0:
        return Broadcast("source", 0, "replicas+snapshot" if rollout else "snapshot", dtype)
    source = tree.leader_of(rank) if staged and tree.stage_of(rank) == "member" else 0
    return Broadcast("receive" if rollout else "relay", source, "replicas" if rollout else "relay", dtype)


def _chunks(cfg, rank: int, topology: Topology, placement: Placement, routes: dict[int, int]) -> Chunks:
    sl = cfg.swimlane
    if placement.world_size == 1:
        return Chunks(local=True)
    adaptive = sl.roles == "adaptive"
    out: dict[str, Any] = {}
    if rank in placement.rollout:
        def transport(learner: int) -> str:  # the placement's on its own route; elsewhere, ipc within a host
            if cfg.data_plane.transport != "auto":  # a forced one wins
                return cfg.data_plane.transport
            if learner == placement.routes[rank]:
                return placement.transports[rank]
            return "ipc" if topology.same_host(learner, rank) else "tcp"

        learners = placement.learners if adaptive else [routes[rank]]
        out.update(routes=tuple(Route(lr, transport(lr)) for lr in learners), first=routes[rank])
    if rank in placement.learners:
        senders = placement.rollout if adaptive else placement.senders_of(rank)
        out.update(senders=tuple(senders),
                   senders_elsewhere=any(topology.host_of(r) != topology.host_of(rank) for r in senders))
    return Chunks(**out)


def check_job(cfg, topology: Topology, placement: Placement) -> None:
    """What the placement makes impossible, refused on every rank alike before anything is
    built (each host can then say it, not only the rank that would have failed)."""
    idle = [lr for lr in placement.learners if not placement.senders_of(lr)]
    if idle and cfg.swimlane.roles != "adaptive":  # (adaptive: every learner takes any rollout rank's chunks)
        raise ConfigError(f"swimlane.learner_ranks: learner rank(s) {', '.join(map(str, idle))} would get chunks "
                          f"from no rollout rank ({len(placement.rollout)} rollout rank(s) for "
                          f"{len(placement.learners)} learners); add processes, lower swimlane.learner_ranks, or "
                          f"set swimlane.colocate=true or swimlane.roles=adaptive")
    if cfg.data_plane.require_auth and (ranks := unauthenticated_tcp(cfg, topology, placement)):
        raise ConfigError(f"data_plane.require_auth: the chunks of rank(s) {', '.join(map(str, ranks))} would "
                          f"cross tcp without authentication; {KEYS_FIX}")


def unauthenticated_tcp(cfg, topology: Topology, placement: Placement) -> list[int]:
    """The rollout ranks whose chunks would cross tcp to a receiver that admits any key (no
    ``data_plane.curve_authorized_dir``): what ``data_plane.require_auth`` refuses (a
    learner's receiver refuses it too, but only the learner's host would then know why)."""
    if cfg.data_plane.curve_authorized_dir is not None or placement.world_size == 1:
        return []
    from swimlane.adaptation.roles import initial_routes

    routes = initial_routes(cfg.swimlane, placement)
    return [r for r in placement.rollout
            if any(route.transport == "tcp" for route in _chunks(cfg, r, topology, placement, routes).routes)]


def plan_rank(cfg, rank: int, topology: Topology, placement: Placement,
              device: torch.device | str = "cpu") -> RankPlan:
    """The plan of ``rank`` in a job of ``cfg`` placed by ``placement`` on ``topology``
    (no process group, env or model is built: a pure function of its arguments)."""
    from swimlane.adaptation.roles import initial_routes

    sl, device = cfg.swimlane, torch.device(device)
    world = placement.world_size
    learner, rollout = rank in placement.learners, rank in placement.rollout
    lanes = (["gradient"] if learner else []) + ["broadcast"] + (["inference", "sampling"] if rollout else [])
    staged = sl.hierarchical_broadcast and len(placement.tree.leaders) > 1
    broadcast = _broadcast(rank, world, rollout, placement, staged, _dtype_name(cfg, device))
    routes = initial_routes(sl, placement)

    grad_sync = "none"
    if learner and sl.learner_ranks > 1:
        grad_sync = "fsdp" if cfg.sharded_learners else "masked_mean" if sl.roles == "adaptive" else "mean"
    groups = None
    if world > 1:
        tree = placement.tree
        groups = Groups(learners=tuple(placement.learners),
                        backend="nccl" if device.type == "cuda" and sl.collective_backend == "auto" else "gloo",
                        stages=Stages(tree.source, tuple(tree.leaders), tuple(tuple(g) for g in tree.local_groups))
                        if staged else None)
    # Where the GPU code paths run: on CUDA, and on a test's recording fake of it (memory/runtime.py).
    accelerated = device.type == "cuda" or runtime.current().accelerated
    pools = Pools()
    if cfg.memory.enabled:
        host = None
        if accelerated and rollout:
            host = "cpu, pinned"
        pools = Pools(persistent=device.type, transient=device.type if learner or rollout else None, host=host)
    streams: tuple[Stream, ...] = ()
    if accelerated and sl.cuda_streams:
        streams = tuple(s for s, on in ((Stream("inference", True), rollout), (Stream("gradient"), learner)) if on)

    checkpoints = "none"
    if learner:
        checkpoints = "write" if rank == 0 else "gather" if cfg.sharded_learners else "resume only"
    notes = []
    if sl.roles == "adaptive" and learner and rank != 0:
        notes.append("candidate learner: samples until the role plan makes it learn")
    return RankPlan(
        rank=rank, world_size=world, host=topology.hosts[topology.host_of(rank)].name, role=placement.role(rank),
        device=str(device), learner=learner, rollout=rollout, lanes=tuple(lanes), broadcast=broadcast,
        chunks=_chunks(cfg, rank, topology, placement, routes), routes=routes,
        env_groups=sl.env_groups + sl.spare_groups if rollout else 0,
        env_groups_stepping=(sl.autotune_start_groups or sl.env_groups) if rollout else 0,
        envs_per_group=cfg.env.n_envs if rollout else 0, grad_sync=grad_sync, groups=groups, pools=pools,
        streams=streams, checkpoints=checkpoints, notes=tuple(notes))


def _channels(plan: RankPlan) -> list[tuple[str, str, str, str]]:
    """``(name, from, to, kind)`` of every way data moves at the rank, for the text."""
    me, out = f"rank{plan.rank}", []
    if plan.rollout:
        out += [("requests", "sampling", "inference", "local"), ("replies", "inference", "sampling", "local")]
    if plan.learner and plan.broadcast.role == "source":
        out.append(("snapshot", "gradient", "broadcast", "local"))
    c = plan.chunks
    if c.local:
        out.append(("chunks", "sampling", "gradient", "local"))
    out += [("chunks", me, f"rank{r.learner}", r.transport) for r in c.routes]
    out += [("chunks", f"rank{s}", me, "data plane") for s in c.senders if s != plan.rank]
    if plan.groups is not None:
        b = plan.broadcast
        out.append(("weights", me, "all ranks", "control") if b.role == "source" else
                   ("weights", f"rank{b.source}", me, "control"))
    return out


def format_plan(plan: RankPlan) -> str:
    """The plan as a short block of text (``--print-rank``)."""
    b = plan.broadcast
    lines = [f"rank {plan.rank} of {plan.world_size} on {plan.host}: {plan.role}, device {plan.device}"]
    lanes = [f"{lane} ({LANE_ROLES[lane].format(b.role + ', ' + BROADCAST_ROLES[b.role])})" for lane in plan.lanes]
    lines.append("  lanes:    " + "; ".join(lanes))
    if plan.rollout:
        spare = plan.env_groups - plan.env_groups_stepping
        lines.append(f"  envs:     {plan.env_groups_stepping} group(s) stepping of {plan.envs_per_group} envs"
                     + (f", {spare} spare" if spare else ""))
    lines.append(f"  weights:  {b.buffers} ({b.dtype})")
    if plan.learner:
        lines.append(f"  learning: gradients {plan.grad_sync}, checkpoints {plan.checkpoints}")
    if plan.groups is not None:
        g = plan.groups
        groups = [f"learners {list(g.learners)}", f"control ({g.backend}, all ranks)"]
        if g.stages is not None:
            groups.append(f"broadcast stages (leaders {list(g.stages.leaders)})")
        lines.append("  groups:   " + "; ".join(groups))
    for name, src, dst, kind in _channels(plan):
        lines.append(f"  channel:  {name:<9} {src} -> {dst} ({kind})")
    p = plan.pools
    pools = [f"{what} ({dev})" for what, dev in (("persistent", p.persistent), ("transient", p.transient),
                                                 ("transient_host", p.host)) if dev]
    lines.append("  pools:    " + ("; ".join(pools) if pools else "none (plain allocation)"))
    if plan.streams:
        lines.append("  streams:  " + "; ".join(f"{s.lane}{' (high priority)' if s.high_priority else ''}"
                                               for s in plan.streams))
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
    check_job(cfg, topology, placement)
    available = runtime.current().available()
    device = torch.device("cpu" if cfg.run.device == "auto" and not available
                          else "cuda:0" if cfg.run.device in ("auto", "cuda") else cfg.run.device)
    # Every rank sees its own GPU alone, as cuda:0 (memory.runtime.visible_device_env).
    return [plan_rank(cfg, rank, topology, placement, device) for rank in range(topology.world_size)]
