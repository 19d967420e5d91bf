"""Allocator churn as rollout lengths vary: plain torch allocation against the TransientPool.

Every iteration draws an episode length L uniformly in [8, 64] and a learner-queue depth in
[1, 4] (both seeded, the same sequence for every variant), then

* allocates a rollout chunk for 8 envs: uint8 images [L, 8, 3, 64, 64], float proprio
  [L, 8, 16], float actions / log-probs / rewards / values [L, 8], bool dones / valid [L, 8],
  and writes every buffer (as a rollout would);
* builds an observation batch: the 8 envs' frames stacked into uint8 [8, 3, 64, 64] plus its
  float copy scaled to [0, 1], used and dropped within the iteration;
* pushes the chunk onto a FIFO and releases the oldest chunks until the FIFO holds `depth`.

Variants, each in a fresh process so neither inherits the other's heap:

* plain (CPU): ``torch.empty``; what the process allocator really holds is read from glibc
  ``mallinfo2()`` every iteration (reserved = arena + hblkhd, in use = uordblks + hblkhd,
  relative to the moment before the loop), fragmentation = 1 - live requested / reserved;
* pool (CPU): a ``TransientPool`` with leases; its own stats (and, for reference, what glibc
  holds for the process in that run);
* on CUDA, if available: the plain caching allocator (``max_memory_reserved``, fragmentation
  from ``memory_stats``) against a ``TransientPool`` on the device (its arena stats, its
  ``MemPool`` segments and the device-wide ``max_memory_reserved`` of that run).

Times cover the loop without the sampling; "alloc" is the part spent allocating and releasing.

    python bench/memory_churn.py --iters 300 --seed 0
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import multiprocessing as mp
import random
import statistics
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor

import torch

N_ENVS = 8
IMAGE = (3, 64, 64)
PROPRIO = 16
MiB = float(1 << 20)


def chunk_spec(L: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    scalar = (L, N_ENVS)
    return [
        ((L, N_ENVS, *IMAGE), torch.uint8),  # images
        ((L, N_ENVS, PROPRIO), torch.float32),  # proprio
        (scalar, torch.float32),  # actions
        (scalar, torch.float32),  # log-probs
        (scalar, torch.float32),  # rewards
        (scalar, torch.float32),  # values
        (scalar, torch.bool),  # dones
        (scalar, torch.bool),  # valid
    ]


def schedule(iters: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(8, 64), rng.randint(1, 4)) for _ in range(iters)]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo():
    """Return a function giving glibc's (reserved, in_use) bytes, or None off glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2

    def held() -> tuple[int, int]:
        m = fn()
        return m.arena + m.hblkhd, m.uordblks + m.hblkhd

    return held


def _nbytes(shape, dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def run_variant(variant: str, device: str, iters: int, seed: int) -> dict:
    """One variant in this process; returns its measurements."""
    torch.set_num_threads(1)  # fills are single-threaded in both variants: less timing noise
    from memory import TransientPool

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sched = schedule(iters, seed)
    g = torch.Generator().manual_seed(seed)
    frames = [
        torch.randint(0, 256, IMAGE, dtype=torch.uint8, generator=g).to(dev) for _ in range(N_ENVS)
    ]
    obs_bytes = _nbytes((N_ENVS, *IMAGE), torch.uint8) + _nbytes((N_ENVS, *IMAGE), torch.float32)
    pool = TransientPool(dev) if variant == "pool" else None
    malloc = _mallinfo() if not cuda else None

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    base = malloc() if malloc else (0, 0)

    fifo: deque = deque()
    live_bytes = 0
    plain_allocs = 0
    t_loop = t_alloc = 0.0
    reserved_s, frag_s, proc_s = [], [], []
    peak_reserved = peak_in_use = peak_proc = 0
    allocs_at_half = None

    for i, (L, depth) in enumerate(sched):
        t0 = time.perf_counter()
        # --- allocate the chunk and the observation batch
        a0 = time.perf_counter()
        spec = chunk_spec(L)
        if pool is not None:
            lease = pool.lease()
            bufs = [lease.empty(shape, dtype) for shape, dtype in spec]
            obs_lease = pool.lease()
            obs = obs_lease.stack(frames)
            obs_f = obs_lease.empty(obs.shape, torch.float32)
        else:
            lease = obs_lease = None
            bufs = [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in spec]
            obs = torch.stack(frames)
            obs_f = torch.empty(obs.shape, dtype=torch.float32, device=dev)
            plain_allocs += len(spec) + 2
        t_alloc += time.perf_counter() - a0
        # --- write it, as a rollout would
        for b in bufs:
            b.fill_(i & 1 if b.dtype == torch.bool else i & 255)
        obs_f.copy_(obs).mul_(1.0 / 255)
        chunk_bytes = sum(b.numel() * b.element_size() for b in bufs)
        fifo.append((lease, bufs, chunk_bytes))
        live_bytes += chunk_bytes
        if cuda:
            torch.cuda.synchronize()
        t_loop += time.perf_counter() - t0

        # --- sample at the high-water mark of the iteration (not timed)
        requested = live_bytes + obs_bytes
        if pool is not None:
            s = pool.stats()
            reserved, in_use = s.reserved_bytes, s.in_use_bytes
            frag = s.fragmentation
            if malloc:
                proc = malloc()[0] - base[0]
                peak_proc = max(peak_proc, proc)
                proc_s.append(proc)
        elif cuda:
            ms = torch.cuda.memory_stats(dev)
            reserved = ms["reserved_bytes.all.current"]
            in_use = ms["allocated_bytes.all.current"]
            frag = 1.0 - ms["requested_bytes.all.current"] / reserved if reserved else 0.0
        else:
            held = malloc()
            reserved, in_use = held[0] - base[0], held[1] - base[1]
            frag = 1.0 - requested / reserved if reserved > 0 else 0.0
        peak_reserved = max(peak_reserved, reserved)
        peak_in_use = max(peak_in_use, in_use)
        reserved_s.append(reserved)
        frag_s.append(frag)

        # --- drop the observation batch, release the oldest chunks
        t0 = time.perf_counter()
        if pool is not None:
            obs_lease.release()
        del obs, obs_f, bufs
        while len(fifo) > depth:
            old_lease, old_bufs, nbytes = fifo.popleft()
            if old_lease is not None:
                old_lease.release()
            del old_bufs
            live_bytes -= nbytes
        dt = time.perf_counter() - t0
        t_alloc += dt
        t_loop += dt
        if i + 1 == iters // 2:
            allocs_at_half = pool.stats().allocations if pool is not None else plain_allocs

    result = {
        "variant": variant,
        "device": str(dev),
        "iters": iters,
        "time_s": t_loop,
        "alloc_time_s": t_alloc,
        "peak_reserved": peak_reserved,
        "peak_in_use": peak_in_use,
        "mean_reserved": statistics.fmean(reserved_s),
        "mean_frag": statistics.fmean(frag_s),
        "frag_at_peak": frag_s[reserved_s.index(peak_reserved)],
    }
    if pool is not None:
        s = pool.stats()
        result["allocations"] = s.allocations
        result["allocations_2nd_half"] = s.allocations - allocs_at_half
        result["reuses"] = s.reuses
        if proc_s:
            result["proc_peak_reserved"] = peak_proc
        if cuda:
            result["segments"] = pool.device_segments()
            result["proc_peak_reserved"] = torch.cuda.max_memory_reserved(dev)
    else:
        result["allocations"] = plain_allocs
        result["allocations_2nd_half"] = plain_allocs - allocs_at_half
        if cuda:
            ms = torch.cuda.memory_stats(dev)
            result["peak_reserved"] = torch.cuda.max_memory_reserved(dev)
            result["segments_created"] = ms["segment.all.allocated"]
    return result


def run_isolated(variant: str, device: str, iters: int, seed: int) -> dict:
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as ex:
        return ex.submit(run_variant, variant, device, iters, seed).result()


def report(title: str, plain: dict, pool: dict) -> None:
    print(f"\n{title}")
    print(
        f"{'':12s}{'peak reserved':>15s}{'peak in use':>15s}{'mean reserved':>15s}"
        f"{'mean frag':>11s}{'frag@peak':>11s}"
        f"{'allocations':>13s}{'2nd half':>10s}{'time':>9s}{'alloc+free':>12s}"
    )
    for name, r in (("plain", plain), ("pool", pool)):
        print(
            f"{name:12s}{r['peak_reserved'] / MiB:>11.1f} MiB{r['peak_in_use'] / MiB:>11.1f} MiB"
            f"{r['mean_reserved'] / MiB:>11.1f} MiB"
            f"{r['mean_frag']:>11.3f}{r['frag_at_peak']:>11.3f}{r['allocations']:>13d}"
            f"{r['allocations_2nd_half']:>10d}{r['time_s']:>8.3f}s{r['alloc_time_s']:>11.3f}s"
        )

    def ratio(key: str) -> str:
        return f"{pool[key] / plain[key]:.3f}" if plain[key] else "n/a"

    print(
        f"{'pool/plain':12s}{ratio('peak_reserved'):>15s}{ratio('peak_in_use'):>15s}"
        f"{ratio('mean_reserved'):>15s}"
        f"{ratio('mean_frag'):>11s}{ratio('frag_at_peak'):>11s}{ratio('allocations'):>13s}"
        f"{'':>10s}{ratio('time_s'):>9s}{ratio('alloc_time_s'):>12s}"
    )
    print(
        "in use: plain = what the allocator has handed out, pool = its blocks handed out;\n"
        "allocations: plain = buffers requested from the allocator, pool = new blocks created;\n"
        "'2nd half' = those made in the second half of the run"
    )
    if "reuses" in pool:
        print(f"pool: {pool['reuses']} requests served from free lists")
    if "proc_peak_reserved" in pool:
        whole = "caching allocator, whole device" if "segments" in pool else "glibc, whole process"
        print(
            f"pool run as the allocator below sees it ({whole}): peak reserved "
            f"{pool['proc_peak_reserved'] / MiB:.1f} MiB"
        )
    if "segments_created" in plain:
        print(
            f"plain CUDA: {plain['segments_created']} segments cudaMalloc'ed; "
            f"pool MemPool segments at the end: {pool.get('segments')}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.iters < 2:
        ap.error("--iters must be at least 2")

    lengths = [L for L, _ in schedule(args.iters, args.seed)]
    print(
        f"iters={args.iters} seed={args.seed} n_envs={N_ENVS} image={IMAGE} "
        f"L in [{min(lengths)}, {max(lengths)}] torch={torch.__version__}"
    )
    if _mallinfo() is None:
        print(
            "glibc mallinfo2() unavailable: the plain CPU numbers would be meaningless; skipping CPU"
        )
    else:
        plain = run_isolated("plain", "cpu", args.iters, args.seed)
        pool = run_isolated("pool", "cpu", args.iters, args.seed)
        report("CPU (plain = glibc malloc via mallinfo2; pool = TransientPool stats)", plain, pool)
    if torch.cuda.is_available():
        plain = run_isolated("plain", "cuda", args.iters, args.seed)
        pool = run_isolated("pool", "cuda", args.iters, args.seed)
        report("CUDA (plain = caching allocator; pool = TransientPool on a MemPool)", plain, pool)
    else:
        print("\nCUDA part skipped: no CUDA device")


if __name__ == "__main__":
    main()
