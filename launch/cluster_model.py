"""What the placement and the weight broadcast would cost on a given cluster (``dvla plan``).

A model, not a measurement. It compares, per weights version, (a) a flat broadcast that
ignores the topology with (b) the hierarchical tree of :mod:`launch.placement`.

Bandwidth model (alpha-beta). Sending m bytes over one link costs ``alpha + m / B``
(alpha = ``latency_us``). Inter-node: every node has ``net_gbps`` of NIC bandwidth in
each direction, shared by all streams that leave (or enter) that node at the same time.
Intra-node: every GPU can send ``local_gbps`` (NVLink) at once. A version is
``S = params * bytes_per_param`` bytes; nodes hold ``g`` ranks each, ``p = N * g``.

* Flat: one broadcast over all p ranks as NCCL runs it, a pipelined ring (a chain in
  torchrun order, host by host, the version cut into small chunks that every rank
  forwards as soon as it has them): ``alpha * (p - 1) + S / B``, with B the slowest link
  of the chain (``B_net`` once it crosses a node: each NIC carries one stream each way).
  So about S / B whatever the number of ranks; N - 1 inter-node copies.
* Hierarchical: stage 1 sends S from the source to the N node leaders, stage 2 from
  each leader to the g ranks of its node. A stage over k ranks costs the better of a
  pipelined chain, ``alpha * (k - 1) + S / B``, and a binomial tree,
  ``ceil(log2 k) * (alpha + S / B)`` (what a tuned collective library would choose).
  Leaders forward bucket i while receiving bucket i+1 (as ``planes.control`` does), so
  with n = ceil(S / bucket_bytes) buckets the two stages overlap:
  ``T = max(T1, T2) + min(T1, T2) / n``. Inter-node copies: N - 1.

Weak scaling. Each node produces ``samples_per_node_s`` rollout samples per second and
contributes ``batch_per_node`` of them to every learner update, which takes
``update_s`` (constant under weak scaling: the global batch and the learners grow with
N). So versions are due every ``interval = max(update_s, batch_per_node /
samples_per_node_s)``. A version's broadcast runs alongside the next update; when it
takes longer than the interval, versions (and, through bounded staleness, rollouts) wait
for it: throughput(N) = N * batch_per_node / max(interval, T_broadcast(N)), efficiency =
throughput(N) / (N * throughput(1)). Gradient all-reduce, trajectory traffic and
congestion are left out, so efficiencies are upper bounds.

For clusters of more than ``PLACE_MAX_RANKS`` ranks the placement's shape (learners,
hosts they span, cross-host routes, leaders) is computed arithmetically instead of
with :func:`launch.placement.place`; both give the same numbers (tested).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field


from launch.placement import Placement, place
from launch.topology import Topology, from_spec

BUCKET_BYTES = 32 << 20  # planes.control.DEFAULT_BUCKET_BYTES
PLACE_MAX_RANKS = 4096
SHOW_PLACEMENT_MAX_RANKS = 64
_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


@dataclass
class BroadcastCost:
    """One method's cost for one weights version."""

    time_s: float
    inter_node_copies: int
    inter_node_bytes: float
    rounds: int = 0          # flat: hops of the ring (p - 1)
    nic_streams: int = 0     # flat: streams through one node's NIC at once (1 each way)
    stage1_s: float = 0.0    # hierarchical: source -> node leaders
    stage2_s: float = 0.0    # hierarchical: leader -> its node's ranks
    buckets: int = 1         # hierarchical: forwarding granularity


@dataclass
class ClusterEstimate:
    nodes: int
    gpus_per_node: int
    ranks: int
    params: float
    bytes_per_version: float
    learners: int
    rollout: int
    colocate: bool
    learner_hosts: int        # hosts the learners' gradient all-reduce spans
    tcp_routes: int           # rollout ranks whose chunks cross hosts
    leaders: int
    flat: BroadcastCost
    hier: BroadcastCost
    interval_s: float
    efficiency_flat: float
    efficiency_hier: float
    placement: Placement | None = None      # only for clusters small enough to place
    topology: Topology | None = None
    notes: list[str] = field(default_factory=list)

    def stage_s(self, stage: int) -> float:
        return self.hier.stage1_s if stage == 1 else self.hier.stage2_s

    @property
    def speedup(self) -> float:
        if self.hier.time_s <= 0:
            return 1.0 if self.flat.time_s <= 0 else math.inf
        return self.flat.time_s / self.hier.time_s


@dataclass
class ScalingPoint:
    nodes: int
    ranks: int
    broadcast_flat_s: float
    broadcast_hier_s: float
    throughput_flat: float    # samples/s the whole cluster turns into updates
    throughput_hier: float
    efficiency_flat: float
    efficiency_hier: float


# -- parsing -------------------------------------------------------------------------------------------

def parse_count(text: str | float) -> float:
    """'7e9', '7B', '1T', '500M', '1.5b', 7000000000 -> a number of parameters."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
        if not m:
            raise ValueError(f"cannot read {text!r} as a count: use e.g. 7e9, 7B, 500M or 1T")
        value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"count {text!r} must be a positive number")
    return value


def parse_nodes(values: list[str] | str) -> list[int]:
    """'1,8,64' or ['1', '8,64'] -> [1, 8, 64]."""
    items = [values] if isinstance(values, str) else list(values)
    out = []
    for item in items:
        for part in str(item).split(","):
            if not part.strip():
                continue
            try:
                n = int(part)
            except ValueError:
                raise ValueError(f"node count {part.strip()!r} is not an integer") from None
            if n < 1:
                raise ValueError(f"node count {n} must be >= 1")
            out.append(n)
    if not out:
        raise ValueError("no node counts given")
    return out


# -- placement shape -------------------------------------------------------------------------------------

def learner_count(ranks: int, learner_fraction: float, colocate: bool) -> tuple[int, bool]:
    """Learner ranks for a fraction of the world (at least 1, leaving a rollout rank
    unless colocated; a single rank is always colocated). Returns (learners, colocate)."""
    if not 0 < learner_fraction <= 1:
        raise ValueError(f"learner_fraction={learner_fraction} must be in (0, 1]")
    if ranks == 1:
        return 1, True
    n = min(ranks, max(1, round(learner_fraction * ranks)))
    if n == ranks and not colocate:
        n = ranks - 1
    return n, colocate


def placement_shape(nodes: int, gpus_per_node: int, learners: int, colocate: bool) -> dict[str, int]:
    """What :func:`place` gives on ``nodes`` x ``gpus_per_node``, in closed form: on equal
    hosts the learners fill hosts in rank order, and only the ranks of hosts without a
    learner send across hosts."""
    ranks = nodes * gpus_per_node
    learner_hosts = -(-learners // gpus_per_node)
    return {"ranks": ranks, "learners": learners, "rollout": ranks if colocate else ranks - learners,
            "learner_hosts": learner_hosts, "tcp_routes": (nodes - learner_hosts) * gpus_per_node,
            "leaders": nodes}


def _shape_of(p: Placement, topo: Topology) -> dict[str, int]:
    return {"ranks": p.world_size, "learners": len(p.learners), "rollout": len(p.rollout),
            "learner_hosts": len({topo.host_of(r) for r in p.learners}),
            "tcp_routes": sum(t == "tcp" for t in p.transports.values()), "leaders": len(p.tree.leaders)}


# -- broadcast cost -------------------------------------------------------------------------------------

def _stage_time(k: int, size: float, bw: float, alpha: float) -> float:
    """Broadcast of ``size`` bytes among k ranks: the better of a pipelined chain and a
    binomial tree."""
    if k <= 1:
        return 0.0
    chain = alpha * (k - 1) + size / bw
    tree = math.ceil(math.log2(k)) * (alpha + size / bw)
    return min(chain, tree)


def flat_broadcast(nodes: int, gpus_per_node: int, size: float, net_bw: float, local_bw: float,
                   alpha: float) -> BroadcastCost:
    """NCCL's pipelined ring over all ranks, host-major numbering (see the module docstring)."""
    p = nodes * gpus_per_node
    if p <= 1:
        return BroadcastCost(0.0, 0, 0.0)
    bw = net_bw if nodes > 1 else local_bw
    copies = nodes - 1
    return BroadcastCost(alpha * (p - 1) + size / bw, copies, copies * size, rounds=p - 1,
                         nic_streams=1 if nodes > 1 else 0)


def hierarchical_broadcast(nodes: int, gpus_per_node: int, size: float, net_bw: float, local_bw: float,
                           alpha: float, bucket_bytes: float = BUCKET_BYTES) -> BroadcastCost:
    """Source -> node leaders -> local ranks, leaders forwarding bucket by bucket."""
    t1 = _stage_time(nodes, size, net_bw, alpha)
    t2 = _stage_time(gpus_per_node, size, local_bw, alpha)
    n_buckets = max(1, math.ceil(size / bucket_bytes))
    total = max(t1, t2) + min(t1, t2) / n_buckets
    return BroadcastCost(total, nodes - 1, (nodes - 1) * size, stage1_s=t1, stage2_s=t2, buckets=n_buckets)


# -- the plan ---------------------------------------------------------------------------------------------

def _interval(update_s: float, batch_per_node: float, samples_per_node_s: float) -> float:
    if update_s < 0 or batch_per_node <= 0 or samples_per_node_s <= 0:
        raise ValueError("update_s must be >= 0, batch_per_node and samples_per_node_s > 0")
    return max(update_s, batch_per_node / samples_per_node_s)


def _throughput(nodes: int, batch_per_node: float, interval: float, broadcast_s: float) -> float:
    return nodes * batch_per_node / max(interval, broadcast_s)


@dataclass
class RankMemory:
    """Bytes one rank holds for the model (activations and the gathered layer of a sharded
    forward pass are not counted)."""

    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    snapshot: float = 0.0    # the copy being published (the source rank)
    replicas: float = 0.0    # two inference replicas, on ranks that roll out
    reference: float = 0.0   # GRPO's reference policy (kl_coef > 0)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.snapshot + self.replicas + self.reference


def rank_memory(params: float, *, learners: int = 1, learns: bool = True, rolls_out: bool = False,
                sharded: bool = False, trainable: float = 1.0, kl: bool = False, source: bool = True,
                master_bytes: float = 4, publish_bytes: float = 4) -> RankMemory:
    """Model memory of one rank. Replicated learner (``algo.shard=none``): fp32 weights, fp32
    gradients and Adam moments of the ``trainable`` share, a snapshot on the source rank, two
    inference replicas when it also rolls out, an fp32 reference with ``kl``. Sharded
    (``algo.shard=fsdp`` over ``learners``): weights, gradients, moments and reference divided
    by ``learners``; the source gathers each tensor (one at a time, not counted) into its
    snapshot. Replicas and snapshots are in ``publish_bytes`` per parameter
    (``swimlane.publish_dtype``)."""
    m = RankMemory()
    if learns:
        div = learners if sharded else 1
        m.weights = master_bytes * params / div
        m.grads = master_bytes * trainable * params / div
        m.optimizer = 2 * master_bytes * trainable * params / div
        if source:
            m.snapshot = publish_bytes * params
        if kl:
            m.reference = master_bytes * params / div
    if rolls_out:
        m.replicas = 2 * publish_bytes * params
    return m


def estimate(nodes: int, gpus_per_node: int, params: float, bytes_per_param: float = 2,
         learner_fraction: float = 0.25, net_gbps: float = 400, local_gbps: float = 2400,
         latency_us: float = 10, *, colocate: bool = False, bucket_bytes: float = BUCKET_BYTES,
         samples_per_node_s: float = 1000.0, batch_per_node: float = 1000.0, update_s: float = 1.0,
         ) -> ClusterEstimate:
    """Placement shape, per-version broadcast cost (flat vs hierarchical) and weak-scaling
    efficiency for ``nodes`` x ``gpus_per_node`` ranks and a model of ``params`` parameters
    (``params`` may be a string such as '7B'). Bandwidths in Gbit/s; see the module
    docstring for the model."""
    nodes, gpus_per_node = int(nodes), int(gpus_per_node)
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"need at least 1 node and 1 GPU per node, got {nodes} x {gpus_per_node}")
    params = parse_count(params)
    if bytes_per_param <= 0 or net_gbps <= 0 or local_gbps <= 0 or latency_us < 0 or bucket_bytes <= 0:
        raise ValueError("bytes_per_param, net_gbps, local_gbps and bucket_bytes must be > 0, latency_us >= 0")
    ranks = nodes * gpus_per_node
    learners, colocate_eff = learner_count(ranks, learner_fraction, colocate)
    notes = []
    if colocate_eff != colocate:
        notes.append("a single rank both learns and samples (colocated)")
    elif round(learner_fraction * ranks) >= ranks and not colocate and ranks > 1:
        notes.append(f"{ranks - 1} learners, to leave one rank for rollouts")

    placement = topology = None
    if ranks <= PLACE_MAX_RANKS:
        topology = from_spec(f"{nodes}x{gpus_per_node}:{gpus_per_node}")
        placement = place(topology, learners, colocate_eff)
        shape = _shape_of(placement, topology)
    else:
        shape = placement_shape(nodes, gpus_per_node, learners, colocate_eff)

    size = params * bytes_per_param
    net_bw, local_bw, alpha = net_gbps * 1e9 / 8, local_gbps * 1e9 / 8, latency_us * 1e-6
    flat = flat_broadcast(nodes, gpus_per_node, size, net_bw, local_bw, alpha)
    hier = hierarchical_broadcast(nodes, gpus_per_node, size, net_bw, local_bw, alpha, bucket_bytes)

    interval = _interval(update_s, batch_per_node, samples_per_node_s)
    base_flat = flat_broadcast(1, gpus_per_node, size, net_bw, local_bw, alpha).time_s
    base_hier = hierarchical_broadcast(1, gpus_per_node, size, net_bw, local_bw, alpha, bucket_bytes).time_s
    eff_flat = max(interval, base_flat) / max(interval, flat.time_s)
    eff_hier = max(interval, base_hier) / max(interval, hier.time_s)

    return ClusterEstimate(nodes=nodes, gpus_per_node=gpus_per_node, ranks=ranks, params=params,
                      bytes_per_version=size, learners=shape["learners"], rollout=shape["rollout"],
                      colocate=colocate_eff, learner_hosts=shape["learner_hosts"], tcp_routes=shape["tcp_routes"],
                      leaders=shape["leaders"], flat=flat, hier=hier, interval_s=interval,
                      efficiency_flat=eff_flat, efficiency_hier=eff_hier, placement=placement,
                      topology=topology, notes=notes)


def weak_scaling(nodes_list=(1, 8, 16, 32, 64, 128, 256, 512, 1024), gpus_per_node: int = 8,
                 params: float | str = 7e9, bytes_per_param: float = 2, net_gbps: float = 400,
                 local_gbps: float = 2400, latency_us: float = 10, *, bucket_bytes: float = BUCKET_BYTES,
                 samples_per_node_s: float = 1000.0, batch_per_node: float = 1000.0,
                 update_s: float = 1.0) -> list[ScalingPoint]:
    """Modelled weak scaling (constant rollout work per node) of flat and hierarchical
    broadcast; efficiency relative to one node, as in the module docstring."""
    size = parse_count(params) * bytes_per_param
    net_bw, local_bw, alpha = net_gbps * 1e9 / 8, local_gbps * 1e9 / 8, latency_us * 1e-6
    interval = _interval(update_s, batch_per_node, samples_per_node_s)

    def times(n: int) -> tuple[float, float]:
        return (flat_broadcast(n, gpus_per_node, size, net_bw, local_bw, alpha).time_s,
                hierarchical_broadcast(n, gpus_per_node, size, net_bw, local_bw, alpha, bucket_bytes).time_s)

    f1, h1 = times(1)
    base_f = _throughput(1, batch_per_node, interval, f1)
    base_h = _throughput(1, batch_per_node, interval, h1)
    out = []
    for n in nodes_list:
        tf, th = times(int(n))
        thr_f = _throughput(n, batch_per_node, interval, tf)
        thr_h = _throughput(n, batch_per_node, interval, th)
        out.append(ScalingPoint(nodes=int(n), ranks=int(n) * gpus_per_node, broadcast_flat_s=tf,
                                broadcast_hier_s=th, throughput_flat=thr_f, throughput_hier=thr_h,
                                efficiency_flat=thr_f / (n * base_f), efficiency_hier=thr_h / (n * base_h)))
    return out
