"""The control plane: versioned weight broadcast over ``torch.distributed``.

Weights are low-frequency, large and must be identical everywhere, so they travel on
collectives (NCCL between GPUs, gloo on CPUs) in a process group of their own, never
the learners' gradient group, so weight traffic and gradient all-reduce do not
interleave on one communicator.

:class:`WeightBroadcaster` lays a module's parameters (and floating buffers) out in a
few flat buckets of at most ``bucket_bytes`` each, grouped by dtype, allocated once,
and rebinds every parameter to a view of its bucket (a flat-parameter layout, as FSDP
and DDP's bucket views do). Publishing is then a handful of large broadcasts straight
from the model's own memory, and receiving writes straight into the replica: no packing,
no unpacking, no allocation per version. Build the broadcaster after the model is on
its device (moving it later breaks the aliasing, which ``publish``/``receive`` detect).
A version is **announced outside any collective**: the source writes its number (a negative
one means shutdown) to the job's key-value store (the c10d store every rank already
shares) before it broadcasts the buckets, and a receiver waits on the store, not in a
collective, for the next announcement (:meth:`WeightBroadcaster.receive_version`). It posts
the broadcast of the buckets only once their data is coming, so no collective ever waits
for the learner to finish an update: a long gap between versions cannot time a group out,
and a pending receive never holds a GPU stream. Every collective runs inside the device
runtime's :meth:`memory.runtime.Runtime.collective` (a communication stream of the
calling thread's own on a GPU). With ``header_words`` the announcement carries that many
integers the source sets per version (``publish(version, header)``), which receivers read
as :attr:`WeightBroadcaster.header`: the swimlane's rebalancing plan (:mod:`swimlane.adaptation.balance`)
rides with each version.

Across hosts the broadcast follows a tree (:func:`hierarchical_stages`): the source
sends each version once over the inter-node group of *node leaders* (one rank per
host), and each leader forwards it over its own host's group. So one version crosses
each inter-node link once, however many ranks a host runs, and a leader forwards
bucket *i* (asynchronously, on the local group) while it receives bucket *i+1*. A
rank's part in the tree is its list of :class:`Stage` s: the stage it receives on (if
any) comes first, then the stages it sends on. ``traffic`` counts bytes and messages
per stage kind and direction, so a run can show which path its weights took.

At construction all ranks compare a checksum of the parameter layout (names, dtypes,
shapes, bucket size): a rank built with a different model fails with
:class:`LayoutMismatchError` on every rank instead of receiving garbage.

:class:`planes.subscriber.WeightSubscriber` runs the receiving side in a background thread
with two staging buffers, so a consumer can ``poll()`` without blocking.
"""

from __future__ import annotations

import collections
from datetime import timedelta
import itertools
import json
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from memory import runtime
from planes.buckets import (
    DEFAULT_BUCKET_BYTES,
    Alloc,
    Bucket,
    LayoutMismatchError,
    layout_buckets,
    layout_checksum,
    named_weights,
)

SHUTDOWN = -1
ANNOUNCE_POLL_S = 0.02  # how often a waiting receiver looks for the next announcement
_instances = itertools.count()  # broadcasters are built in one order on every rank (a collective)


def backend_for(device: torch.device | str) -> str:
    """The collective backend for tensors on ``device``: NCCL for CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def new_control_group(ranks: list[int] | None = None, device: torch.device | str = "cpu",
                      timeout: timedelta | None = None, backend: str | None = None) -> dist.ProcessGroup:
    """A process group for weight traffic only, with the backend of the weights' device
    (:func:`backend_for`) and ``timeout`` for its collectives (the backend's default when
    None: 10 minutes for NCCL, 30 for gloo). Must be called by every rank of the default
    group (a torch.distributed rule). ``backend``: gloo for ranks that share a GPU."""
    return dist.new_group(ranks if ranks is not None else list(range(dist.get_world_size())),
                          backend=backend or backend_for(device), timeout=timeout)


@dataclass
class Stage:
    """One hop of the broadcast tree as seen by one rank: a collective on ``group`` whose
    sender is global rank ``root``. ``kind``: ``flat`` (one group of all ranks),
    ``inter`` (node leaders) or ``local`` (the ranks of one host)."""

    group: dist.ProcessGroup | None
    root: int
    kind: str
    size: int


def hierarchical_stages(leaders: list[int], local_groups: list[list[int]], src: int,
                        backend: str | None = None, timeout: timedelta | None = None) -> list[Stage]:
    """Create the tree's process groups and return this rank's stages, in order.

    ``leaders``: one rank per host (the source is its own host's leader);
    ``local_groups``: every host's ranks, in the same host order. Creating groups is a
    collective: every rank of the default group must call this with the same arguments.
    """
    if src not in leaders:
        raise ValueError(f"control plane: the source rank {src} must lead its host (leaders {leaders})")
    if len(leaders) != len(local_groups) or any(ld not in g for ld, g in zip(leaders, local_groups)):
        raise ValueError(f"control plane: leaders {leaders} do not match the host groups {local_groups}")
    backend = backend or backend_for("cpu")
    me = dist.get_rank()
    inter = dist.new_group(leaders, backend=backend, timeout=timeout) if len(leaders) > 1 else None
    local = [dist.new_group(g, backend=backend, timeout=timeout) if len(g) > 1 else None for g in local_groups]
    stages = []
    if inter is not None and me in leaders:
        stages.append(Stage(inter, src, "inter", len(leaders)))
    for leader, ranks, pg in zip(leaders, local_groups, local):
        if pg is not None and me in ranks:
            stages.append(Stage(pg, leader, "local", len(ranks)))
    return stages


class WeightBroadcaster:
    """Bucketed, versioned broadcast of ``module``'s weights from ``src`` (a global rank).

    ``group`` holds every rank of the control plane (the layout check runs on it, and so
    does the broadcast unless ``stages`` gives this rank's part of a tree, see
    :func:`hierarchical_stages`).

    ``frozen``: names of parameters that never change (a frozen backbone, LoRA's base
    weights). They get buckets of their own, which go out with the first version only: later
    versions carry the trainable weights alone (``last_version_bytes`` says how much)."""

    def __init__(self, module: nn.Module, *, src: int = 0, group: dist.ProcessGroup | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, stages: list[Stage] | None = None,
                 alloc: Alloc | None = None, frozen: frozenset[str] = frozenset(),
                 device: torch.device | None = None, header_words: int = 0, store=None):
        """``device``: where the weights travel (default: the module's); a relay rank passes
        a module on the meta device, its layout only (:meth:`relay_buckets`); ``header_words``:
        integers that travel with each version number (the same on every rank); ``store``:
        where versions are announced (default: the default process group's store)."""
        if bucket_bytes < 1:
            raise ValueError(f"control_plane.bucket_bytes: must be >= 1, got {bucket_bytes}")
        self.module = module
        self.src = src
        self.group = group
        self.rank = dist.get_rank()
        self.is_src = self.rank == src
        if stages is None:
            stages = [Stage(group, src, "flat", dist.get_world_size(group))]
        self.stages = stages
        self._recv_stage = None if self.is_src else stages[0]
        if self._recv_stage is not None and self._recv_stage.root == self.rank:
            raise ValueError("control plane: a receiving rank's first stage must be one it receives on")
        self._send_stages = [s for s in stages if s.root == self.rank]
        if self.is_src and len(self._send_stages) != len(stages):
            raise ValueError("control plane: the source rank only sends")
        self.traffic: collections.Counter = collections.Counter()
        self.alloc = alloc
        self.bucket_bytes = bucket_bytes
        entries = named_weights(module)
        if not entries:
            raise ValueError("control plane: the module has no parameters to broadcast")
        self.device = torch.device(device) if device is not None else entries[0][1].device
        self.names = [n for n, _ in entries]
        self.frozen = frozenset(frozen)
        self.checksum = layout_checksum(entries, bucket_bytes, self.frozen)
        self._check_layout()
        self.buckets = self._build_buckets(entries)
        self.nbytes = sum(b.flat.numel() * b.flat.element_size() for b in self.buckets)
        self.frozen_sent = False  # source: the frozen buckets went out; receiver: they came in
        self.last_version_bytes = 0  # bytes of the last version sent or received (once, not per stage)
        self.header_words = header_words
        self.header: list[int] = [0] * header_words  # the words of the last version announced
        self.version = -1
        self.rt = runtime.for_device(self.device)
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self._prefix = f"dvla/weights/{next(_instances)}/"
        self._announced = 0  # announcements made (source) or read (receivers)

    def _check_layout(self) -> None:
        world = dist.get_world_size(self.group)
        mine = torch.tensor([self.checksum], dtype=torch.int64, device=self.device)
        all_sums = [torch.zeros_like(mine) for _ in range(world)]
        with runtime.for_device(self.device).collective():
            dist.all_gather(all_sums, mine, group=self.group)
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(world))
        src_sum = all_sums[ranks.index(self.src)].item()
        bad = [r for r, s in zip(ranks, all_sums) if s.item() != src_sum]
        if bad:
            raise LayoutMismatchError(
                f"control plane: parameter layout checksum of rank(s) {bad} differs from source rank "
                f"{self.src} ({src_sum:#x}); every rank must build the same model with the same "
                f"bucket size (this rank: {self.checksum:#x})"
            )

    @property
    def receives_from(self) -> int | None:
        """The rank each version comes from (the source, or this host's leader in a staged
        broadcast); None on the source."""
        return None if self._recv_stage is None else self._recv_stage.root

    def _build_buckets(self, entries: list[tuple[str, Tensor]]) -> list[Bucket]:
        buckets = layout_buckets(self.module, entries, self.bucket_bytes, self.device, self.alloc, "broadcast",
                                 self.frozen)
        self._ptrs = [t.data_ptr() for _, t in named_weights(self.module)]
        return buckets

    def bind_replica(self, module: nn.Module, tag: str = "replica") -> list[Tensor]:
        """Lay ``module`` (a second copy of the same model, e.g. a standby inference replica)
        out in buckets of this broadcaster's layout and return its flat tensors, so that
        ``receive(into=...)`` writes straight into it. No collective is involved."""
        entries = named_weights(module)
        if layout_checksum(entries, self.bucket_bytes, self.frozen) != self.checksum:
            raise LayoutMismatchError("control plane: bind_replica() got a module with a different layout")
        return [b.flat for b in layout_buckets(module, entries, self.bucket_bytes, self.device, self.alloc, tag,
                                               self.frozen)]

    @property
    def frozen_buckets(self) -> list[int]:
        """Indices of the buckets of frozen parameters."""
        return [i for i, b in enumerate(self.buckets) if b.frozen]

    def _carried(self) -> list[int]:
        """Indices of the buckets the next version carries: all of them the first time, then
        the trainable ones."""
        return [i for i, b in enumerate(self.buckets) if not b.frozen or not self.frozen_sent]

    def _check_aliasing(self) -> None:
        if [t.data_ptr() for _, t in named_weights(self.module)] != self._ptrs:
            raise RuntimeError(
                "control plane: the model's parameters no longer live in the broadcast buckets "
                "(was it moved with .to() or were parameters replaced after the broadcaster was built?)"
            )

    # -- source -------------------------------------------------------------------------------
    @torch.no_grad()
    def publish(self, version: int, header: list[int] | None = None) -> None:
        """Broadcast the current weights as ``version`` (source rank only), with ``header``
        (``header_words`` integers; default zeros)."""
        if not self.is_src:
            raise RuntimeError("publish() is for the source rank; other ranks call receive()")
        if version < 0 or version <= self.version:
            raise ValueError(f"versions must increase and be >= 0: got {version} after {self.version}")
        self._check_aliasing()
        carried = self._carried()
        self._announce(version, header)
        # Every bucket is posted at once and then waited for: the backend streams them back
        # to back instead of a hand-over to its worker thread and a wait between one
        # collective and the next.
        with self.rt.collective():
            works = [self._send(st, self.buckets[i].flat, async_op=True) for st in self._send_stages
                     for i in carried]
            for work in works:
                work.wait()
        self._forget(self._announced - 2)  # every receiver has read the announcement before it
        self.last_version_bytes = sum(self.buckets[i].flat.numel() * self.buckets[i].flat.element_size()
                                      for i in carried)
        self.frozen_sent = True
        self.version = version

    def shutdown(self) -> None:
        """Tell receivers that no further version will come (source rank only)."""
        self._announce(SHUTDOWN, None)

    def _announce(self, version: int, header: list[int] | None) -> None:
        words = [int(w) for w in header] if header is not None else [0] * self.header_words
        if len(words) != self.header_words:
            raise ValueError(f"control plane: a header of {len(words)} words, expected {self.header_words}")
        self.store.set(f"{self._prefix}{self._announced}", json.dumps([version, *words]))
        self._announced += 1
        self.header = words

    def _forget(self, n: int) -> None:
        if n >= 0:
            try:
                self.store.delete_key(f"{self._prefix}{n}")
            except (RuntimeError, NotImplementedError):  # a store that cannot delete keeps it
                pass

    def _send(self, st: Stage, flat: Tensor, async_op: bool = False):
        work = dist.broadcast(flat, src=st.root, group=st.group, async_op=async_op)
        self.traffic[f"{st.kind}_sent_bytes"] += flat.numel() * flat.element_size()
        self.traffic[f"{st.kind}_sent"] += 1
        return work

    def _recv(self, flat: Tensor, async_op: bool = False):
        st = self._recv_stage
        work = dist.broadcast(flat, src=st.root, group=st.group, async_op=async_op)
        self.traffic[f"{st.kind}_received_bytes"] += flat.numel() * flat.element_size()
        self.traffic[f"{st.kind}_received"] += 1
        return work

    # -- receivers ------------------------------------------------------------------------------
    @torch.no_grad()
    def receive(self, into: list[Tensor] | None = None, after: Any = None) -> int:
        """Block for the next version and write it straight into the module (or, with
        ``into``, into those flat tensors, one per bucket), once the device work before the
        event ``after`` is done (the copies out of ``into`` that :meth:`load_flat` queued on
        another thread's stream). Returns the version, or ``SHUTDOWN``."""
        version = self.receive_version()
        if version != SHUTDOWN:
            self.rt.wait_event(after)  # (the collective's stream follows this thread's: memory/runtime.py)
            self.receive_buckets(version, into)
        return version

    def receive_version(self, stop: threading.Event | None = None) -> int | None:
        """First half of :meth:`receive`: wait (on the store, in no collective) until the
        source announces a version (or ``SHUTDOWN``); None if ``stop`` is set first. The
        caller must then call :meth:`receive_buckets` for that version; splitting lets it
        choose the destination only once the data is about to arrive."""
        if self.is_src:
            raise RuntimeError("receive() is for non-source ranks")
        key = f"{self._prefix}{self._announced}"
        stop = stop or threading.Event()
        while not self.store.check([key]):
            if stop.wait(ANNOUNCE_POLL_S):
                return None
        words = json.loads(self.store.get(key))
        self._announced += 1
        self.header = [int(w) for w in words[1:]]
        return int(words[0])

    @torch.no_grad()
    def receive_buckets(self, version: int, into: list[Tensor] | None = None) -> None:
        """Second half of :meth:`receive`: the bucket contents of ``version`` (the frozen
        buckets only with the first version: see :attr:`frozen_sent`)."""
        if into is None:
            self._check_aliasing()
        flats = into if into is not None else [b.flat for b in self.buckets]
        self._take(lambda n, i: (i, flats[i]))  # every bucket a place of its own
        if into is None:
            self.version = version

    @torch.no_grad()
    def relay_buckets(self, version: int) -> None:
        """:meth:`receive_buckets` on a rank that keeps nothing (a learner that does not roll
        out): every bucket lands in one of two scratch buffers per dtype, at most a bucket
        each, and is passed on to this rank's host when it leads one. The broadcaster may be
        built on a meta-device module: no copy of the model exists here."""
        if not hasattr(self, "_scratch"):  # made once: the largest bucket of each dtype, twice
            longest: dict[torch.dtype, int] = {}
            for b in self.buckets:
                longest[b.flat.dtype] = max(longest.get(b.flat.dtype, 0), b.flat.numel())
            self._scratch = {dt: [torch.empty(n, dtype=dt, device=self.device) for _ in range(2)]
                             for dt, n in longest.items()}
        scratch = self._scratch

        def place(n: int, i: int) -> tuple:
            flat = self.buckets[i].flat
            return (flat.dtype, n % 2), scratch[flat.dtype][n % 2][: flat.numel()]

        self._take(place)
        self.version = version

    def _take(self, place) -> None:
        """Receive the buckets this version carries, the ``n``-th (bucket ``i``) into
        ``place(n, i) -> (key, tensor)``; a node leader forwards each to its host while it
        receives the next. A place is reused (same key) only once the collectives on it are
        done; a leaf posts its receives at once and waits at the end."""
        carried = self._carried()
        self.frozen_sent = True
        self.last_version_bytes = sum(self.buckets[i].flat.numel() * self.buckets[i].flat.element_size()
                                      for i in carried)
        busy: dict = {}  # place -> its collectives in flight
        with self.rt.collective():
            for n, i in enumerate(carried):
                key, flat = place(n, i)
                for work in busy.pop(key, []):
                    work.wait()
                if not self._send_stages:
                    busy[key] = [self._recv(flat, async_op=True)]
                    continue
                self._recv(flat)
                busy[key] = [self._send(st, flat, async_op=True) for st in self._send_stages]
            for works in busy.values():
                for work in works:
                    work.wait()

    @torch.no_grad()
    def load_flat(self, flats: list[Tensor], version: int) -> Any:
        """Copy a received set of flat buckets into the model (one copy per bucket), queued
        on the calling thread's stream; returns the event after the copies (None on the CPU):
        ``flats`` may be written again only once it is done (:meth:`receive` ``after=``)."""
        for b, flat in zip(self.buckets, flats):
            self.rt.copy_async(b.flat, flat)
        self.version = version
        return self.rt.record_event()

    def staging_buffers(self) -> list[Tensor]:
        """A fresh set of flat tensors shaped like the buckets (for double buffering). The
        frozen buckets' tensors are shared by every set: they arrive once, for all."""
        if not hasattr(self, "_frozen_staging"):
            self._frozen_staging = {i: torch.empty_like(self.buckets[i].flat) for i in self.frozen_buckets}
        return [self._frozen_staging.get(i, None) if b.frozen else torch.empty_like(b.flat)
                for i, b in enumerate(self.buckets)]
