"""Which ranks share a host, and what each host has: discovered at start-up or given.

At start-up every rank describes itself (:func:`local_info`: host name, visible GPUs
and how they are linked, usable CPUs, NUMA nodes), writes that as JSON to the
``torch.distributed`` store under ``{prefix}/{rank}`` and reads everybody else's entry
back (:func:`discover`). Ranks that report the same host name form one
:class:`HostInfo`. JSON rather than ``all_gather_object`` keeps pickle out of it, and
the store is usable before any process group exists.

Host identity is :func:`host_name`: the ``DVLA_FAKE_HOSTNAME`` environment variable if set,
else the machine's name (the data plane reads the same variable, ``planes.data``), so two
``torchrun`` invocations on one machine can act as two hosts, exactly as the data plane
sees them.

For planning and tests, :func:`from_spec` builds a topology from a short description
("2x4", "2x4:8", ``[4, 2]`` or a :meth:`Topology.to_dict` dict) with ranks numbered
host by host, as ``torchrun`` numbers them.

GPU links are what ``nvidia-smi topo -m`` prints between two GPUs: ``X`` (itself),
``NV<n>`` (n NVLinks, directly or through NVSwitch), ``PIX``/``PXB`` (one or several
PCIe switches), ``PHB`` (a PCIe host bridge), ``NODE`` (within a NUMA node) or ``SYS``
(across NUMA nodes). They are read with ``pynvml`` when it is importable, else from
``nvidia-smi topo -m``, else left ``None``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
from dataclasses import asdict, dataclass, field
from typing import Any

from launch.gpu_links import gpu_links

_SPEC_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*(?::\s*(\d+)\s*)?$")


@dataclass
class HostInfo:
    """One host: its global ranks (sorted) with their local ranks, and its hardware."""

    name: str
    ranks: list[int]
    local_ranks: list[int]
    gpus: int = 0
    gpu_names: list[str] = field(default_factory=list)
    cpus: int = 0
    numa_nodes: int = 0
    gpu_links: list[list[str]] | None = None  # GPU x GPU matrix as nvidia-smi prints it


@dataclass
class Topology:
    """All hosts, ordered by their lowest rank (so the host of rank 0 comes first)."""

    hosts: list[HostInfo]
    world_size: int
    _host_index: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.hosts = sorted(self.hosts, key=lambda h: min(h.ranks) if h.ranks else -1)
        seen: dict[int, int] = {}
        for i, h in enumerate(self.hosts):
            if not h.ranks:
                raise ValueError(f"topology: host {h.name!r} has no ranks")
            if len(h.local_ranks) != len(h.ranks):
                raise ValueError(f"topology: host {h.name!r} lists {len(h.ranks)} ranks but "
                                 f"{len(h.local_ranks)} local ranks")
            if h.ranks != sorted(h.ranks):  # keep each local rank next to its rank
                pairs = sorted(zip(h.ranks, h.local_ranks))
                h.ranks, h.local_ranks = [r for r, _ in pairs], [lr for _, lr in pairs]
            for r in h.ranks:
                if r in seen:
                    raise ValueError(f"topology: rank {r} is on host {self.hosts[seen[r]].name!r} "
                                     f"and on host {h.name!r}")
                seen[r] = i
        if sorted(seen) != list(range(self.world_size)):
            missing = sorted(set(range(self.world_size)) - set(seen))
            extra = sorted(set(seen) - set(range(self.world_size)))
            raise ValueError(f"topology: hosts must hold ranks 0..{self.world_size - 1} once each "
                             f"(missing {missing}, out of range {extra})")
        self._host_index = seen

    @property
    def n_hosts(self) -> int:
        return len(self.hosts)

    def host_of(self, rank: int) -> int:
        """Index into ``hosts`` of the host that runs ``rank``."""
        try:
            return self._host_index[rank]
        except KeyError:
            raise ValueError(f"topology: no rank {rank} (world size {self.world_size})") from None

    def same_host(self, a: int, b: int) -> bool:
        return self.host_of(a) == self.host_of(b)

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "hosts": [asdict(h) for h in self.hosts]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Topology:
        if not isinstance(d, dict) or "hosts" not in d:
            raise ValueError(f"topology: a dict needs 'hosts' (and 'world_size'), got {d!r:.200}")
        fields = set(HostInfo.__dataclass_fields__)
        hosts = []
        for h in d["hosts"]:
            unknown = set(h) - fields
            if unknown:
                raise ValueError(f"topology: unknown host fields {sorted(unknown)}")
            h = dict(h)
            h["ranks"] = [int(r) for r in h["ranks"]]
            h["local_ranks"] = [int(r) for r in h.get("local_ranks", range(len(h["ranks"])))]
            hosts.append(HostInfo(**h))
        world = d.get("world_size", sum(len(h.ranks) for h in hosts))
        return cls(hosts, int(world))


# -- what one rank knows ---------------------------------------------------------------------------

def _numa_nodes() -> int:
    return len(glob.glob("/sys/devices/system/node/node[0-9]*"))


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


def _cuda() -> tuple[int, list[str]]:
    try:
        from memory import runtime  # torch kept out of planning-only imports

        rt = runtime.current()
        n = rt.device_count()
        names = []
        for i in range(n):
            try:
                names.append(rt.device_name(i))
            except Exception:  # noqa: BLE001
                names.append("?")
        return n, names
    except Exception:  # noqa: BLE001
        return 0, []


def host_name() -> str:
    """This machine's name as placement sees it (``DVLA_FAKE_HOSTNAME`` overrides it)."""
    return os.environ.get("DVLA_FAKE_HOSTNAME") or socket.gethostname()


def local_info(rank: int, local_rank: int, hostname: str | None = None, links: bool = True) -> dict[str, Any]:
    """What this process knows about itself, as a JSON-able dict. Never raises: what
    cannot be found out is 0, [] or None. ``hostname`` overrides the host name (tests);
    ``links=False`` skips probing GPU links (the same for every rank of a host)."""
    gpus, names = _cuda()
    return {
        "rank": int(rank),
        "local_rank": int(local_rank),
        "hostname": hostname if hostname is not None else host_name(),
        "gpus": gpus,
        "gpu_names": names,
        "cpus": _cpus(),
        "numa_nodes": _numa_nodes(),
        "gpu_links": gpu_links() if gpus and links else None,
    }


# -- all ranks -------------------------------------------------------------------------------------

def _group(infos: list[dict[str, Any]], world_size: int) -> Topology:
    by_host: dict[str, list[dict[str, Any]]] = {}
    for info in sorted(infos, key=lambda i: i["rank"]):
        by_host.setdefault(str(info["hostname"]), []).append(info)
    hosts = []
    for name, members in by_host.items():
        # Ranks of one host may see different GPU subsets (CUDA_VISIBLE_DEVICES per rank)
        # or CPU sets (pinning): keep the widest view any of them had.
        widest = max(members, key=lambda i: i.get("gpus", 0))
        links = next((i["gpu_links"] for i in members if i.get("gpu_links")), None)
        hosts.append(HostInfo(
            name=name,
            ranks=[i["rank"] for i in members],
            local_ranks=[i.get("local_rank", 0) for i in members],
            gpus=widest.get("gpus", 0),
            gpu_names=list(widest.get("gpu_names", [])),
            cpus=max(i.get("cpus", 0) for i in members),
            numa_nodes=max(i.get("numa_nodes", 0) for i in members),
            gpu_links=links,
        ))
    return Topology(hosts, world_size)


def discover(store, rank: int, world_size: int, local_rank: int = 0, prefix: str = "dvla/topo",
             hostname: str | None = None) -> Topology:
    """Every rank calls this: publish ``local_info`` under ``{prefix}/{rank}``, wait for
    all ``world_size`` entries and group them into hosts. All ranks get the same result.
    Blocks up to the store's timeout for the slowest rank. Use a fresh ``prefix`` to run
    it again in the same store. Only local rank 0 probes GPU links (nvidia-smi takes a
    moment); its host-mates share the result."""
    if not 0 <= rank < world_size:
        raise ValueError(f"topology: rank {rank} outside world size {world_size}")
    info = local_info(rank, local_rank, hostname=hostname, links=local_rank == 0)
    store.set(f"{prefix}/{rank}", json.dumps(info))
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.wait(keys)
    infos = []
    for r, key in enumerate(keys):
        raw = store.get(key)
        entry = json.loads(raw.decode() if isinstance(raw, (bytes, bytearray)) else raw)
        if entry.get("rank") != r:
            raise ValueError(f"topology: store key {key} holds rank {entry.get('rank')}'s entry")
        infos.append(entry)
    return _group(infos, world_size)


# -- given in config --------------------------------------------------------------------------------

def local_topology(links: bool = False) -> Topology:
    """This process alone (a world of one), with what it can see of its host."""
    return _group([local_info(0, 0, links=links)], 1)


def _uniform(counts: list[int], gpus: int | None) -> Topology:
    hosts, r = [], 0
    for i, n in enumerate(counts):
        hosts.append(HostInfo(name=f"host{i}", ranks=list(range(r, r + n)), local_ranks=list(range(n)),
                              gpus=gpus if gpus is not None else 0))
        r += n
    return Topology(hosts, r)


def from_spec(spec) -> Topology:
    """A topology from config: ``"HxR"`` (H hosts of R ranks), ``"HxR:G"`` (and G GPUs
    per host; without it GPUs are unknown, 0), a list of per-host rank counts such as
    ``[4, 2]``, a :meth:`Topology.to_dict` dict, or a Topology (returned as is). Ranks are
    numbered host by host, like torchrun does; hosts are called host0, host1, ..."""
    if isinstance(spec, Topology):
        return spec
    if isinstance(spec, dict):
        return Topology.from_dict(spec)
    if isinstance(spec, str):
        m = _SPEC_RE.match(spec)
        if not m:
            raise ValueError(f"topology spec {spec!r}: expected 'HOSTSxRANKS' or 'HOSTSxRANKS:GPUS', "
                             "e.g. '2x4' or '2x4:8'")
        h, r = int(m.group(1)), int(m.group(2))
        g = int(m.group(3)) if m.group(3) is not None else None
        if h < 1 or r < 1:
            raise ValueError(f"topology spec {spec!r}: needs at least 1 host and 1 rank per host")
        return _uniform([r] * h, g)
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ValueError("topology spec []: needs at least one host")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in spec):
            raise ValueError(f"topology spec {list(spec)!r}: per-host rank counts must be integers >= 1")
        return _uniform(list(spec), None)
    raise ValueError(f"topology spec {spec!r}: expected a string like '2x4', a list of per-host "
                     "rank counts, or a dict from Topology.to_dict()")


# -- text -------------------------------------------------------------------------------------------

def rank_ranges(ranks) -> str:
    """[0, 1, 2, 3, 6] -> '0-3,6'."""
    rs = sorted(ranks)
    if not rs:
        return "-"
    parts, start, prev = [], rs[0], rs[0]
    for r in rs[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts)


def _link_summary(links: list[list[str]] | None) -> str:
    if not links:
        return ""
    kinds = sorted({c for i, row in enumerate(links) for j, c in enumerate(row) if i != j})
    return f", links {'/'.join(kinds)}" if kinds else ""


def describe(topology: Topology) -> str:
    """A few lines: hosts, their ranks and hardware."""
    t = topology
    lines = [f"{t.n_hosts} host{'s' if t.n_hosts != 1 else ''}, "
             + f"{t.world_size} rank{'s' if t.world_size != 1 else ''}"]
    for h in t.hosts:
        hw = []
        if h.gpus:
            names = sorted(set(h.gpu_names))
            hw.append(f"{h.gpus} GPU{'s' if h.gpus != 1 else ''}" + (f" ({', '.join(names)})" if names else ""))
        if h.cpus:
            hw.append(f"{h.cpus} CPUs")
        if h.numa_nodes:
            hw.append(f"{h.numa_nodes} NUMA node{'s' if h.numa_nodes != 1 else ''}")
        lines.append(f"  {h.name}: ranks {rank_ranges(h.ranks)} (local {rank_ranges(h.local_ranks)})"
                     + (f"; {', '.join(hw)}" if hw else "") + _link_summary(h.gpu_links))
    return "\n".join(lines)
