"""Roles, data routes and the weight-broadcast tree, derived from a :class:`Topology`.

:func:`place` decides, from the hosts and a number of learner ranks:

* **Learners.** Rank 0 is always a learner and the broadcast source. Learners fill the
  source's host first (lowest ranks first), then whole other hosts, the hosts with the
  most ranks first (ties: the host order, i.e. lowest rank first), lowest ranks first
  within each. So the learners' gradient all-reduce spans as few hosts as possible; on
  hosts of equal size this is simply "the next hosts in rank order".
* **Rollout ranks.** Every rank that is not a learner; with ``colocate`` the learners as
  well (they then have the role ``learner+rollout``). Without ``colocate`` at least one
  rank must be left for rollouts.
* **Routes.** Each rollout rank sends its trajectory chunks to one learner. A colocated
  learner sends to itself. Other rollout ranks go to a learner on their own host when
  that host has one (the least loaded of them; ties: the lowest rank), and only after
  all such host-local choices are made do ranks on hosts without a learner take the
  least-loaded learner overall (ties: lowest rank). Loads are the number of rollout
  ranks already routed to a learner.
* **Transports.** ``ipc`` when a rollout rank and its learner share a host, else ``tcp``.
* **Broadcast tree.** One leader per host: the source on its own host, the lowest rank
  elsewhere. The source sends each weights version to the other leaders (the only
  inter-node traffic: ``hosts - 1`` copies per version), and every leader passes it on
  to the ranks of its host. ``leaders`` and ``local_groups`` are in host order and are
  what ``planes.control.hierarchical_stages`` takes.

Invalid requests (``learner_ranks`` < 1 or > world size, or no rank left for rollouts
with ``colocate=False``) raise ``ValueError``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

from launch.topology import Topology, rank_ranges

ROLES = ("learner", "rollout", "learner+rollout")


@dataclass
class BroadcastTree:
    """Source -> one leader per host (inter-node) -> the rest of each host (intra-node)."""

    source: int
    leaders: list[int]
    local_groups: list[list[int]]

    def _host(self, rank: int) -> int:
        for i, g in enumerate(self.local_groups):
            if rank in g:
                return i
        raise ValueError(f"broadcast tree: no rank {rank}")

    def leader_of(self, rank: int) -> int:
        """The leader of ``rank``'s host (the rank it receives weights from, unless it
        is a leader itself)."""
        return self.leaders[self._host(rank)]

    def stage_of(self, rank: int) -> str:
        """``source``; ``leader`` (receives over the inter-node stage and forwards to its
        host); or ``member`` (receives from its host's leader)."""
        if rank == self.source:
            return "source"
        return "leader" if self.leader_of(rank) == rank else "member"

    @property
    def inter_node_copies(self) -> int:
        """How many copies of one weights version cross between hosts."""
        return len(self.leaders) - 1

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "leaders": list(self.leaders),
                "local_groups": [list(g) for g in self.local_groups]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BroadcastTree:
        return cls(int(d["source"]), [int(r) for r in d["leaders"]],
                   [[int(r) for r in g] for g in d["local_groups"]])


@dataclass
class Placement:
    """Who learns, who samples, where the samples go, and how weights travel."""

    world_size: int
    learners: list[int]
    rollout: list[int]
    source: int
    routes: dict[int, int]       # rollout rank -> learner rank it sends chunks to
    transports: dict[int, str]   # rollout rank -> "ipc" | "tcp"
    tree: BroadcastTree

    def role(self, rank: int) -> str:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"placement: no rank {rank} (world size {self.world_size})")
        learner, rollout = rank in self.learners, rank in self.routes
        if learner and rollout:
            return "learner+rollout"
        return "learner" if learner else "rollout"

    def senders_of(self, learner: int) -> list[int]:
        """The rollout ranks that send their chunks to ``learner`` (sorted)."""
        if learner not in self.learners:
            raise ValueError(f"placement: rank {learner} is not a learner (learners {self.learners})")
        return sorted(r for r, dst in self.routes.items() if dst == learner)

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "learners": list(self.learners),
            "rollout": list(self.rollout),
            "source": self.source,
            "routes": {str(r): dst for r, dst in sorted(self.routes.items())},
            "transports": {str(r): t for r, t in sorted(self.transports.items())},
            "tree": self.tree.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Placement:
        p = cls(
            world_size=int(d["world_size"]),
            learners=[int(r) for r in d["learners"]],
            rollout=[int(r) for r in d["rollout"]],
            source=int(d["source"]),
            routes={int(r): int(dst) for r, dst in d["routes"].items()},
            transports={int(r): str(t) for r, t in d["transports"].items()},
            tree=BroadcastTree.from_dict(d["tree"]),
        )
        p.check()
        return p

    def check(self) -> None:
        """Raise ``ValueError`` unless the placement is self-consistent."""
        w = self.world_size
        if self.source != 0 or 0 not in self.learners:
            raise ValueError("placement: rank 0 must be a learner and the broadcast source")
        if any(not 0 <= r < w for r in [*self.learners, *self.rollout]):
            raise ValueError(f"placement: ranks outside 0..{w - 1}")
        if set(self.learners) | set(self.rollout) != set(range(w)):
            raise ValueError("placement: some ranks have no role")
        if set(self.routes) != set(self.rollout) or set(self.transports) != set(self.rollout):
            raise ValueError("placement: every rollout rank needs exactly one route and transport")
        if any(dst not in self.learners for dst in self.routes.values()):
            raise ValueError("placement: a route leads to a rank that is not a learner")
        if any(t not in ("ipc", "tcp") for t in self.transports.values()):
            raise ValueError("placement: transports must be 'ipc' or 'tcp'")
        if sorted(r for g in self.tree.local_groups for r in g) != list(range(w)):
            raise ValueError("placement: the broadcast tree must cover every rank once")


def _choose_learners(topology: Topology, n: int) -> list[int]:
    src_host = topology.host_of(0)
    others = sorted((i for i in range(topology.n_hosts) if i != src_host),
                    key=lambda i: (-len(topology.hosts[i].ranks), i))
    chosen: list[int] = []
    for i in [src_host, *others]:
        chosen += sorted(topology.hosts[i].ranks)[: n - len(chosen)]
        if len(chosen) == n:
            break
    return sorted(chosen)


def place(topology: Topology, learner_ranks: int, colocate: bool) -> Placement:
    """Roles, routes, transports and broadcast tree; the rules are in the module docstring."""
    world = topology.world_size
    if isinstance(learner_ranks, bool) or not isinstance(learner_ranks, int):
        raise ValueError(f"placement: learner_ranks must be an integer, got {learner_ranks!r}")
    if not 1 <= learner_ranks <= world:
        raise ValueError(f"placement: learner_ranks={learner_ranks} must be between 1 and the world "
                         f"size {world}")
    if not colocate and learner_ranks == world:
        raise ValueError(f"placement: all {world} ranks are learners and colocate=False, so no rank is "
                         "left to run rollouts (use fewer learner ranks or colocate=True)")
    learners = _choose_learners(topology, learner_ranks)
    learner_set = set(learners)
    rollout = list(range(world)) if colocate else [r for r in range(world) if r not in learner_set]

    load = {ln: 0 for ln in learners}
    routes: dict[int, int] = {}
    host_heaps: dict[int, list[tuple[int, int]]] = {}
    for ln in learners:
        host_heaps.setdefault(topology.host_of(ln), []).append((0, ln))
    if colocate:  # a learner that also samples keeps its chunks in-process
        for ln in learners:
            routes[ln] = ln
            load[ln] += 1
        host_heaps = {h: [(load[ln], ln) for _, ln in hp] for h, hp in host_heaps.items()}
    for hp in host_heaps.values():
        heapq.heapify(hp)
    remote = []
    for r in rollout:
        if r in routes:
            continue
        hp = host_heaps.get(topology.host_of(r))
        if hp is None:
            remote.append(r)
            continue
        n, ln = heapq.heappop(hp)
        routes[r] = ln
        load[ln] = n + 1
        heapq.heappush(hp, (n + 1, ln))
    everyone = [(n, ln) for ln, n in load.items()]
    heapq.heapify(everyone)
    for r in remote:
        n, ln = heapq.heappop(everyone)
        routes[r] = ln
        heapq.heappush(everyone, (n + 1, ln))
    routes = dict(sorted(routes.items()))
    transports = {r: "ipc" if topology.same_host(r, dst) else "tcp" for r, dst in routes.items()}

    src_host = topology.host_of(0)
    leaders = [0 if i == src_host else min(h.ranks) for i, h in enumerate(topology.hosts)]
    tree = BroadcastTree(source=0, leaders=leaders, local_groups=[sorted(h.ranks) for h in topology.hosts])
    p = Placement(world_size=world, learners=learners, rollout=rollout, source=0, routes=routes,
                  transports=transports, tree=tree)
    p.check()
    return p


def format_placement(p: Placement, topo: Topology) -> str:
    """Per-host table of ranks, roles, routes (with transport) and broadcast stage."""
    head = (f"placement: {p.world_size} ranks on {topo.n_hosts} host{'s' if topo.n_hosts != 1 else ''}; "
            f"learners {rank_ranges(p.learners)} ({len(p.learners)}), "
            f"rollout {rank_ranges(p.rollout)} ({len(p.rollout)}), broadcast source {p.source}")
    lines = [head]
    for h in topo.hosts:
        lines.append(f"  {h.name} (ranks {rank_ranges(h.ranks)})")
        lines.append(f"    {'rank':>5} {'local':>5}  {'role':<16} {'sends to':>8} {'via':<4} weights")
        for r, lr in sorted(zip(h.ranks, h.local_ranks)):
            dst = p.routes.get(r)
            stage = p.tree.stage_of(r)
            how = {"source": "source", "leader": f"leader, from {p.source} (inter-node)",
                   "member": f"from {p.tree.leader_of(r)} (local)"}[stage]
            lines.append(f"    {r:>5} {lr:>5}  {p.role(r):<16} {'-' if dst is None else dst:>8} "
                         f"{p.transports.get(r, '-'):<4} {how}")
    load = ", ".join(f"{ln}<-{len(p.senders_of(ln))}" for ln in p.learners)
    n_tcp = sum(t == "tcp" for t in p.transports.values())
    lines.append(f"  rollout ranks per learner: {load}; {n_tcp} of {len(p.routes)} routes cross hosts (tcp)")
    lines.append(f"  broadcast tree: source {p.tree.source} -> leaders {rank_ranges(p.tree.leaders)} "
                 f"({p.tree.inter_node_copies} inter-node cop{'y' if p.tree.inter_node_copies == 1 else 'ies'} "
                 "per version) -> each leader's host")
    return "\n".join(lines)
