"""Scaling: measured throughput with 1, 2, 4 rollout processes here, and the planner's
modelled weak scaling on large clusters.

Measured: ``torchrun --standalone`` with one learner-only rank and N rollout ranks
(``swimlane.colocate=false``) on the pure-torch reaching task with ``render_cost_ms`` of
native CPU work per rendered batch (the stand-in for a simulator's renderer; 40 ms makes
the workload simulation-bound, as the genesis jobs are). Each update takes one chunk
from every rollout rank, so the work per rollout rank stays the same as N grows (weak
scaling). Printed: env steps/s consumed by the learner and the speed-up
against N=1 measured in the same run. Every process needs a core: with fewer cores
than processes the speed-up is capped by the cores, and the output says so.

Modelled: :func:`launch.cluster_model.weak_scaling` for 8..1024 nodes, flat against
hierarchical weight broadcast (its bandwidth model is printed with it).

    python bench/scaling.py --rollouts 1,2,4 --iterations 12 --render-cost-ms 40
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def measure(n_rollout: int, args, tmp: Path) -> dict:
    out = tmp / f"r{n_rollout}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n_rollout + 1}",
           "-m", "dvla.launch", "--preset", "fast_reach", f"run.iterations={args.iterations}",
           f"env.n_envs={args.envs}", f"env.image_size={args.image}", "env.episode_len=12",
           f"env.options.render_cost_ms={args.render_cost_ms}", "swimlane.colocate=false",
           "swimlane.env_groups=2", f"swimlane.chunks_per_update={n_rollout}", "swimlane.trace=false",
           "run.torch_threads=1", "run.progress=false", f"run.out_dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"run with {n_rollout} rollout ranks failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", default="1,2,4", help="rollout process counts to measure")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--envs", type=int, default=32)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--render-cost-ms", type=float, default=40.0)
    ap.add_argument("--params", default="7B", help="model size for the modelled part")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    counts = [int(x) for x in args.rollouts.split(",")]

    print(f"measured on this machine ({cores} cores), 1 learner + N rollout processes:")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            s = measure(n, args, Path(tmp))
            sps = s["env_steps_per_s"]
            base = base or sps
            # N=1's rollout rank keeps about one core busy: the speed-up cannot pass the cores.
            note = f"  ({n + 1} processes on {cores} cores: speed-up capped near {cores}x)" if n + 1 > cores else ""
            print(f"  N={n}: {sps:8.0f} env steps/s  speed-up {sps / base:.2f}x  "
                  f"efficiency {sps / base / n:.2f}{note}", flush=True)

    from dvla.app.plan import main as plan_main

    print(f"\nmodelled weak scaling ({args.params} parameters, {args.gpus_per_node} GPUs per node):")
    plan_main(["--nodes", "8,64,256,1024", "--params", args.params, "--gpus-per-node", str(args.gpus_per_node)])


if __name__ == "__main__":
    main()
