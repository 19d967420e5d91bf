"""Memory pools against the plain caching allocator near the device's capacity (issue #48, 4).

A learner-like loop: an MLP of ``--layers`` x ``--hidden`` with AdamW, ``--updates`` updates,
each on a batch whose size is drawn (seeded, the same for both variants) between a quarter
of ``--batch`` and all of it. The process may use ``--fraction`` of the GPU
(``torch.cuda.set_per_process_memory_fraction``), and ``--batch 0`` sizes the largest batch so
that weights, gradients, optimizer state and activations fill about 90 % of that.

* ``plain``: every tensor from the caching allocator;
* ``pools``: dvla's pools as a learner rank uses them: the optimizer state adopted into the
  persistent pool, each batch from a transient-pool lease, the forward pass's activations
  routed into the transient pool's MemPool (``TransientPool.activations``).

Each variant runs in a fresh process. Printed: device memory reserved after every 10th update,
the peak, the updates that ran out of memory (each is skipped: its gradients dropped), the
MemPools given back near capacity, updates per second; then pools/plain of the peak. A pool
that keeps memory the backward pass cannot use shows as a higher peak or as OOMs the plain run
does not have.

On the CPU (``--device cpu``, the kit's rehearsal) the loop runs small with no device
allocator to read: it checks that the two variants run and learn alike.

    python bench/pool_pressure.py --device cuda --fraction 0.1 --updates 50
    python bench/pool_pressure.py --device cpu --updates 4 --hidden 64 --layers 2 --batch 64
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = float(1 << 20)


def _largest_batch(args, budget: int) -> int:
    params = args.layers * args.hidden * args.hidden * 4
    activations_per_row = args.layers * args.hidden * 4 * 3  # input, pre-activation and output of each layer
    return max(16, int((0.9 * budget - 4.5 * params) / activations_per_row))


def run_variant(variant: str, args) -> dict:
    import torch

    from memory import MemoryManager, runtime

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    rt = runtime.for_device(device)
    rt.bind_thread()
    if cuda:
        total = rt.total_memory(0)
        torch.cuda.set_per_process_memory_fraction(args.fraction, 0)
        budget = int(args.fraction * total)
    else:
        budget = 0
    batch = args.batch or _largest_batch(args, budget)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mm = None
    if variant == "pools":
        mm = MemoryManager(device)
        mm.persistent.adopt_optimizer(opt)
    sizes = random.Random(args.seed)
    schedule = [sizes.randint(batch // 4, batch) for _ in range(args.updates)]
    reserved, ooms, losses = [], 0, []
    t0 = time.perf_counter()
    for i, b in enumerate(schedule):
        try:
            if mm is not None:
                lease = mm.transient.lease()
                x = lease.empty((b, args.hidden), torch.float32)
                x.copy_(torch.randn(b, args.hidden, device=device, generator=None))
                with mm.transient.activations():
                    loss = model(x).square().mean()
                loss.backward()
                lease.release()
            else:
                x = torch.randn(b, args.hidden, device=device)
                loss = model(x).square().mean()
                loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        except torch.OutOfMemoryError:
            ooms += 1
        opt.zero_grad(set_to_none=True)
        loss = x = None
        if cuda:
            rt.synchronize()
            reserved.append(torch.cuda.memory_reserved(0))
    wall = time.perf_counter() - t0
    out = {"variant": variant, "batch": batch, "updates_per_s": args.updates / wall, "ooms": ooms,
           "reserved": reserved, "peak_reserved": torch.cuda.max_memory_reserved(0) if cuda else None,
           "budget": budget, "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
           "retired": mm.transient.mempools_retired if mm is not None else 0}
    return out


def _isolated(variant: str, args) -> dict:
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_variant, (variant, args))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fraction", type=float, default=0.1, help="of the GPU's memory this process may use")
    ap.add_argument("--updates", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=0, help="largest batch (0: fill about 90 %% of the budget)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    results = {}
    for variant in ("plain", "pools", "pools", "plain")[: 2 if args.device == "cpu" else 4]:  # alternated on a GPU
        r = _isolated(variant, args)
        results.setdefault(variant, []).append(r)
        every = r["reserved"][9::10]
        print(f"{variant}: batch<={r['batch']} updates/s={r['updates_per_s']:.2f} ooms={r['ooms']} "
              f"mempools_given_back={r['retired']} loss {r['first_loss']:.4g} -> {r['last_loss']:.4g}"
              + (f" peak_reserved={r['peak_reserved'] / MiB:.0f} MiB of {r['budget'] / MiB:.0f}; reserved every 10 "
                 f"updates: {', '.join(f'{x / MiB:.0f}' for x in every)} MiB" if r["peak_reserved"] else ""), flush=True)
    plain, pools = results["plain"], results["pools"]
    ooms = {v: sum(r["ooms"] for r in rs) for v, rs in results.items()}
    if ooms["plain"] or ooms["pools"]:  # the runs took different batches: compare what ran out of memory
        same = ooms["pools"] <= ooms["plain"]
    else:
        same = all(abs(a["last_loss"] - b["last_loss"]) <= 1e-3 * abs(a["last_loss"]) + 1e-6
                   for a, b in zip(plain, pools))
    if args.device != "cpu":
        peak = sorted(p["peak_reserved"] / q["peak_reserved"] for p, q in zip(pools, plain))
        print(f"ratio pools/plain peak reserved = {peak[len(peak) // 2]:.3f} (runs {', '.join(f'{x:.3f}' for x in peak)}); "
              f"ooms pools {sum(p['ooms'] for p in pools)} plain {sum(p['ooms'] for p in plain)}")
    print(f"pool_pressure: {'PASS' if same else 'FAIL'} (pools run out of memory no more often than plain, and "
          f"without running out learn alike: last loss {pools[0]['last_loss']:.6g} vs {plain[0]['last_loss']:.6g})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
