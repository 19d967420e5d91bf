"""The GPU paths a machine with one GPU can run, each checked end to end and timed.

* ``colocated``: one rank in async mode on ``run.device`` with memory pools, CUDA streams and
  bf16 inference replicas (``swimlane.publish_dtype=bf16``) for several versions; midway the
  env groups that step change (one, then two again), so the inference lane meets new batch
  shapes while the gradient lane updates. Passes when every version is learned and published,
  the replica holds the last one, and each lane's pool kept to its own thread (a second thread
  in a pool raises). Figure: env steps/s, and versions per second.
* ``receiver``: two processes on the same GPU (``CUDA_VISIBLE_DEVICES`` lists one, shared):
  a learner-only rank 0 and a rollout-only rank 1, the control plane on gloo with CUDA
  tensors (``swimlane.collective_backend=gloo``: NCCL needs a GPU per rank). Passes when rank
  1's replica holds the last version. Figure: versions received per second.

On a CPU (``--device cpu``, the suite's ``--cpu-smoke``) the same runs take the CPU runtime.

    python bench/gpu_paths.py colocated --device cuda --iterations 12
    python bench/gpu_paths.py receiver --device cuda --iterations 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def colocated(args) -> bool:
    from dvla.config import apply_overrides
    from dvla.config.presets import fast_reach
    from swimlane import Swimlane

    out = Path(tempfile.mkdtemp(prefix="gpu_paths_"))
    cfg = apply_overrides(fast_reach(), [
        f"run.out_dir={out}", f"run.device={args.device}", f"run.iterations={args.iterations}", "run.progress=false",
        f"env.n_envs={args.envs}", f"env.image_size={args.image}", "swimlane.env_groups=2",
        "swimlane.cuda_streams=true", "memory.enabled=true", "swimlane.publish_dtype=bf16", "swimlane.trace=false",
        "swimlane.max_staleness=8"])  # both groups admitted at once: their requests share forward passes
    lanes = Swimlane(cfg)
    shapes: set[int] = set()
    answer = None

    def on_update(record) -> None:  # new inference shapes mid-run: one group steps, then two again
        nonlocal answer
        if lanes.lanes.sampling is not None:
            lanes.lanes.sampling.active = 1 if record["version"] == args.iterations // 3 else (
                2 if record["version"] == 2 * args.iterations // 3 else lanes.lanes.sampling.active)
        if answer is None and lanes.lanes.inference is not None:
            inner = answer = lanes.lanes.inference._answer

            def recording(policy, version, kind, batch):
                shapes.add(sum(r.obs.batch_size for r in batch))
                return inner(policy, version, kind, batch)

            lanes.lanes.inference._answer = recording
            lanes.lanes.inference.wait_s = 0.05  # batch the groups that step: 2 x n_envs, then n_envs

    lanes.updates.on_update = on_update
    t0 = time.perf_counter()
    summary = lanes.run()
    wall = time.perf_counter() - t0
    ok = summary["version"] == args.iterations and summary.get("replica_version") == args.iterations and \
        not summary.get("error") and len(shapes) > 1
    print(f"colocated: {'PASS' if ok else 'FAIL'} device={args.device} versions={summary['version']} "
          f"replica={summary.get('replica_version')} batch_shapes={sorted(shapes)} "
          f"env_steps_per_s={summary.get('env_steps_per_s', 0):.0f} versions_per_s={summary['version'] / wall:.2f}")
    return ok


def receiver(args) -> bool:
    out = Path(tempfile.mkdtemp(prefix="gpu_paths_"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dvla.launch",
           "--preset", "fast_reach", f"run.device={args.device}", f"run.iterations={args.iterations}",
           f"run.out_dir={out}", "run.name=r", "run.progress=false", f"env.n_envs={args.envs}",
           f"env.image_size={args.image}", "swimlane.colocate=false", "swimlane.collective_backend=gloo",
           "memory.enabled=true", "swimlane.cuda_streams=true", "swimlane.trace=false"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    try:
        lead = json.loads((out / "r" / "summary.json").read_text())
        other = json.loads((out / "r" / "summary_rank1.json").read_text())
    except (OSError, ValueError):
        print(f"receiver: FAIL exit {proc.returncode}\n{proc.stderr[-3000:]}")
        return False
    ok = proc.returncode == 0 and lead["version"] == args.iterations and other.get("replica_version") == args.iterations
    print(f"receiver: {'PASS' if ok else 'FAIL'} device={args.device} versions={lead['version']} "
          f"rank1_replica={other.get('replica_version')} roles={lead['role']}/{other['role']} "
          f"visible={lead.get('cuda_visible_devices')}/{other.get('cuda_visible_devices')} "
          f"versions_per_s={lead['version'] / wall:.2f} (torchrun start included)")
    if not ok:
        print(proc.stderr[-3000:])
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", choices=["colocated", "receiver"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--envs", type=int, default=32)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    return 0 if (colocated if args.path == "colocated" else receiver)(args) else 1


if __name__ == "__main__":
    sys.exit(main())
