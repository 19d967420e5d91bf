"""Weight-broadcast throughput of the control plane, measured in one run.

Ranks on this machine join a gloo group on loopback (NCCL where CUDA is present); rank 0
broadcasts a model of ``--mb`` MB made of ``--layers`` parameter tensors, three ways,
interleaved over ``--repeats`` rounds:

* raw: one ``dist.broadcast`` of a single flat tensor of the same size, holding values (the
  ceiling);
* dvla: ``WeightBroadcaster.publish``/``receive`` (pack into buckets, version, bucketed
  broadcasts, unpack into the replica's parameters);
* naive: one ``dist.broadcast`` per parameter tensor.

Interleaved over rounds in alternating order (raw, dvla, naive, then naive, dvla, raw).
Prints GB/s (median) and the ratios dvla/raw (target >= 0.95) and dvla/naive.

    python bench/weight_broadcast.py --world 2 --mb 200 --layers 200
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from dvla.distributed import shutdown
from planes.control import WeightBroadcaster, new_control_group


def _model(mb: float, layers: int, device: torch.device) -> nn.Module:
    per = int(mb * 1e6 / 4 / layers)
    return nn.ParameterList([nn.Parameter(torch.randn(per, device=device)) for _ in range(layers)])


def _timed(fn, device) -> float:
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - t0


def _worker(rank, world, port, args, out):
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device(f"cuda:{rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    group = new_control_group(device=device)
    model = _model(args.mb, args.layers, device)
    bc = WeightBroadcaster(model, src=0, group=group, bucket_bytes=int(args.bucket_mb * 1e6))
    # The raw baseline sends real values: a never-written buffer would be read from the
    # shared zero page on the sender, which is faster than any real model (measured: 200 MB in
    # about 35 ms from torch.empty, 42 ms from random values, on this machine).
    flat = torch.randn(bc.nbytes // 4, device=device)
    version = 0

    def raw():
        dist.broadcast(flat, src=0, group=group)

    def dvla():
        nonlocal version
        version += 1
        bc.publish(version) if rank == 0 else bc.receive()

    def naive():
        for p in model.parameters():
            dist.broadcast(p.data, src=0, group=group)

    fns = {"raw": raw, "dvla": dvla, "naive": naive}
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        _timed(fn, device)
    for i in range(args.repeats):  # interleaved, so all three see the same machine noise,
        order = list(fns.items())  # in alternating order, so none always follows the same one
        for name, fn in order if i % 2 == 0 else order[::-1]:
            times[name].append(_timed(fn, device))
    if rank == 0:
        out.put({"times": times, "nbytes": bc.nbytes, "buckets": len(bc.buckets), "device": str(device),
                 "backend": dist.get_backend(group)})
    shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mb", type=float, default=200)
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--bucket-mb", type=float, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    res = out.get(timeout=1800)
    for p in procs:
        p.join()
    gb = res["nbytes"] / 1e9
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    print(f"world={args.world} backend={res['backend']} device={res['device']} model={gb * 1e3:.0f} MB "
          f"in {args.layers} tensors, {res['buckets']} buckets of <= {args.bucket_mb} MB, median of {args.repeats}")
    for k in ("raw", "dvla", "naive"):
        print(f"{k:6s} {gb / med[k]:7.2f} GB/s  ({med[k] * 1e3:8.1f} ms)")
    print(f"ratio dvla/raw = {med['raw'] / med['dvla']:.3f}  (target >= 0.95)")
    print(f"ratio dvla/naive = {med['naive'] / med['dvla']:.3f}  (bucketing vs one collective per tensor)")


if __name__ == "__main__":
    main()
