"""Process-group setup and teardown shared by the launcher, the swimlane and the benches.

Teardown needs care with gloo: a gloo worker thread drops its reference to a finished
collective (and to the Python tensors it holds) a moment *after* the caller sees the
collective complete. If the interpreter is already finalizing at that moment, the
thread cannot take the GIL and the process aborts with "terminate called without an
active exception" (seen in CI, about one exit in ten). ``shutdown()`` therefore runs a
barrier first: while the main thread waits in it (GIL released) the worker threads
finish their decrefs, and no rank tears down while another is still mid-collective.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from dvla.config.errors import ConfigError
from memory import runtime
from planes.addresses import interface_of, is_loopback, route_to

log = logging.getLogger("dvla")


def select_interfaces(environ=os.environ) -> str | None:
    """Point gloo and NCCL at the network that reaches the rendezvous host: without
    ``GLOO_SOCKET_IFNAME`` gloo binds the address this host's *name* resolves to, which on
    a cluster is often another network (or nothing routable). Sets ``GLOO_SOCKET_IFNAME``
    and ``NCCL_SOCKET_IFNAME`` to the interface on the route to ``MASTER_ADDR``, unless
    they are set already or ``MASTER_ADDR`` is loopback (one host). Returns the interface
    chosen, or None."""
    master = environ.get("MASTER_ADDR")
    if not master or is_loopback(master):
        return None
    try:
        ifname = interface_of(route_to(master))
    except OSError as exc:
        log.warning("no route to MASTER_ADDR=%s (%s): GLOO_SOCKET_IFNAME left unset", master, exc)
        return None
    if ifname is None or ifname == "lo":
        return None
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        environ.setdefault(var, ifname)
    return ifname


def default_backend(device: str, collective_backend: str = "auto") -> str:
    """The default group's backend for a run on ``device`` (``run.device``): on CUDA both
    NCCL (CUDA tensors) and gloo (CPU tensors: metrics, flags), else gloo alone; gloo alone
    too with ``collective_backend="gloo"`` (``swimlane.collective_backend``: ranks that share
    a GPU)."""
    cuda = device in ("auto", "cuda") or device.startswith("cuda:")
    if collective_backend == "gloo":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cuda and runtime.current().available() else "gloo"


def check_one_gpu_each(backend: str, environ=os.environ) -> None:
    """NCCL takes one GPU per rank: ranks of a host that share one (``CUDA_VISIBLE_DEVICES``
    lists fewer GPUs than the host has ranks) are refused with one line, before any group is
    made, instead of NCCL's "Duplicate GPU detected" at the first collective."""
    if "nccl" not in backend:
        return
    local, world = int(environ.get("LOCAL_RANK", "0") or 0), int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    sharing = runtime.ranks_sharing_gpu(local, world, environ)
    if len(sharing) > 1:
        listed = ",".join(runtime.host_gpus(environ))
        raise ConfigError(f"swimlane.collective_backend: local ranks {', '.join(map(str, sharing))} of this host would "
                          f"share one GPU (CUDA_VISIBLE_DEVICES={listed} for {world} ranks), and NCCL takes one GPU "
                          f"per rank: set swimlane.collective_backend=gloo, or start as many ranks per host as GPUs")


def init_from_env(timeout_s: float = 600.0, device: str = "auto", collective_backend: str = "auto") -> tuple[int, int]:
    """Join the process group that torchrun describes in the environment, with the
    backend of ``device`` (the run's ``run.device``: :func:`default_backend`).

    Returns ``(rank, world_size)``; ``(0, 1)`` without touching torch.distributed when the
    environment names no group (a plain ``python -m dvla.launch``).
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    select_interfaces()
    backend = default_backend(device, collective_backend)
    check_one_gpu_each(backend)
    # With NCCL the group is bound to the rank's one visible GPU (memory.runtime.visible_device_env)
    # as it is made: its communicator is then built here, not by whichever collective comes
    # first (the barrier of shutdown() on a rank whose peer has left, which would wait out
    # the whole collective timeout).
    bound = {}
    if resolve_device(device).type == "cuda":
        runtime.for_device(resolve_device(device)).bind_thread()
        if "nccl" in backend:
            bound = {"device_id": torch.device("cuda", resolve_device(device).index or 0)}
    timeout = timedelta(seconds=timeout_s)
    store = store_client(timeout_s)
    if store is not None:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout, **bound)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, **bound)
    return dist.get_rank(), dist.get_world_size()


def store_client(timeout_s: float = 600.0):
    """Under torchrun, a connection of its own to the job's store (the agent's, which outlives
    every worker), in this attempt's key space: the store the process group is built on, as
    another client. None elsewhere (a plain launch, or a store a rank hosts itself)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    # The agent keeps its store across restarts of the worker group: every attempt gets a
    # key space of its own, or a restarted group reads the previous attempt's addresses
    # (gloo then fails to connect to dead ranks).
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"dvla/attempt{attempt}/", agent)


def uses_nccl() -> bool:
    """Whether the job's default group has an NCCL backend (a CUDA run)."""
    return dist.is_initialized() and "nccl" in str(dist.get_backend_config())


def shutdown(barrier: bool = True) -> None:
    """Destroy every process group, after a barrier unless ``barrier=False`` (use that
    on an error path, where a peer may never reach the barrier). On that path NCCL's
    communicators are aborted, all of them at once (a destroy would wait for a peer that
    is gone, and aborts of several communicators one by one can deadlock each other)."""
    if not dist.is_initialized():
        return
    if not barrier and uses_nccl():
        dist.distributed_c10d._abort_process_group()
        return
    try:
        if barrier:
            with runtime.current().collective():  # (a barrier is a collective: not on a compute stream)
                dist.barrier()
    finally:
        dist.destroy_process_group()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if runtime.current().available() else "cpu")
    if name.startswith("cuda") and not runtime.current().available():
        raise RuntimeError(f"run.device={name!r} but CUDA is not available on this machine")
    return torch.device(name)


GRAD_BUCKET_BYTES = 32 << 20


def allreduce_mean_grads(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None = None,
                         bucket_bytes: int = GRAD_BUCKET_BYTES, masked: bool = False, contributes: bool = True) -> int:
    """Average gradients over ``group`` (default: the default process group), bucket by
    bucket: consecutive gradients of one dtype and device up to ``bucket_bytes`` are packed
    into one buffer for one all-reduce, and a gradient as large as a bucket is reduced in
    place, so that no copy of all gradients at once is ever made (at most one bucket's
    worth). A parameter without a gradient counts as zero, so every rank sends the same
    layout even when some parameters were unused on it.

    ``masked`` (learners that switch roles, ``swimlane.roles=adaptive``): the average is over
    the members that ``contributes`` (had samples this step), not over the whole group. A
    member that does not contribute sends zeros, and one more all-reduce adds up how many
    did, so the result is exactly the mean of the contributors' gradients whatever the group
    size. Every member then holds the same gradient and takes the same optimizer step.
    Returns the number of members averaged over (0: nobody contributed, the gradients are
    zero and the step should be skipped)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    world = dist.get_world_size(group)
    if masked:
        device = params[0].grad.device if params else torch.device("cpu")
        count = torch.tensor([1.0 if contributes else 0.0], dtype=torch.float64, device=device)
        with runtime.current().collective():
            dist.all_reduce(count, group=group)
        world = round(float(count))
        if not contributes:
            for p in params:
                p.grad.zero_()
        if world == 0:
            return 0
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if len(bucket) == 1:  # alone in its bucket: reduced where it lies
            dist.all_reduce(bucket[0], group=group)
            bucket[0].div_(world)
        elif bucket:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        bucket, size = [], 0

    # On the communication stream (memory/runtime.py), which waits for the backward pass
    # that wrote the gradients; the host waits for the reductions before the step reads them.
    with runtime.current().collective():
        for p in params:
            g = p.grad
            nbytes = g.numel() * g.element_size()
            if bucket and (size + nbytes > bucket_bytes or g.dtype != bucket[0].dtype or g.device != bucket[0].device):
                flush()
            bucket.append(g)
            size += nbytes
        flush()
    return world


def sum_over_group(stats: dict[str, float], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Add every value of ``stats`` up over the ranks of ``group`` (one all-reduce)."""
    t = torch.tensor(list(stats.values()), dtype=torch.float64)
    with runtime.current().collective():
        dist.all_reduce(t, group=group)
    return dict(zip(stats, t.tolist()))


def mean_over_group(stats: dict[str, float], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Average every value of ``stats`` over the ranks of ``group`` (one all-reduce)."""
    n = dist.get_world_size(group)
    return {k: v / n for k, v in sum_over_group(stats, group).items()}


def _json_bytes(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def broadcast_json(obj, src: int, group: dist.ProcessGroup | None = None):
    """``obj`` (JSON values) from global rank ``src`` to every rank of ``group``, as two
    CPU tensor broadcasts (length, bytes): no pickle crosses the wire. On the thread's
    communication stream (:meth:`memory.runtime.Runtime.collective`), as every collective."""
    data = _json_bytes(obj) if dist.get_rank() == src else torch.empty(0, dtype=torch.uint8)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    with runtime.current().collective():
        dist.broadcast(n, src=src, group=group)
        if dist.get_rank() != src:
            data = torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(data, src=src, group=group)
    return json.loads(bytes(data.numpy()).decode())


def tensor_layout(tensors: dict[str, torch.Tensor]) -> list:
    """``[name, shape, dtype, device type]`` of every tensor, by name: what the other ranks of
    :func:`broadcast_tensors` need to receive them (JSON, for :func:`broadcast_json`)."""
    return [[k, list(t.shape), str(t.dtype).removeprefix("torch."), t.device.type] for k, t in sorted(tensors.items())]


def broadcast_tensors(tensors: dict[str, torch.Tensor] | None, layout: list, src: int = 0,
                      group: dist.ProcessGroup | None = None,
                      device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Global rank ``src``'s ``tensors`` on every rank of ``group``, one broadcast each in the
    order of ``layout`` (:func:`tensor_layout`, which every rank must have); the others receive
    into new tensors, on ``device`` where the sender's were not on the CPU. On the thread's
    communication stream (:meth:`memory.runtime.Runtime.collective`), as every collective."""
    if dist.get_rank() != src:
        tensors = {k: torch.empty(shape, dtype=getattr(torch, dtype),
                                  device=device if kind != "cpu" and device is not None else "cpu")
                   for k, shape, dtype, kind in layout}
    with runtime.current().collective():
        for k, *_ in layout:
            t = tensors[k]
            dist.broadcast(t if t.is_contiguous() else t.contiguous(), src=src, group=group)
    return tensors


def all_gather_json(obj, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj`` (JSON values), in group rank order, without pickle."""
    data = _json_bytes(obj)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    with runtime.current().collective():
        dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(out, padded, group=group)
    return [json.loads(bytes(t[: int(s)].numpy()).decode()) for t, s in zip(out, sizes)]
