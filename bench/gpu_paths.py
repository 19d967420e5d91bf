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

* ``sync``: sync mode with deterministic algorithms, four ways: the serial and the threaded
  driver, each with CUDA streams on and off. Passes when all four end with bit-identical
  weights (a stream race, or a lane reading weights mid-copy, breaks that first).
* ``group`` (under torchrun): a learner rank's collectives on the launcher's group, each
  checked (``cpu:gloo,cuda:nccl`` on a GPU; see :func:`group`).
* ``resume``: a run on the CPU stopped by SIGTERM (a checkpoint on its way out), then
  continued with ``--resume`` on ``--device``: a CPU run's generator states meet a GPU's.
  Passes when the resumed run ends at ``--iterations`` with every update accounted for.

Both runs of ``colocated`` and ``receiver`` also check the weights: the replica's digest equals
the digest of the learner's last version as published (cast to the publish dtype).

On a CPU (``--device cpu``, the kit's ``--cpu-rehearsal``) the same runs take the CPU runtime.

    python bench/gpu_paths.py colocated --device cuda --iterations 12
    python bench/gpu_paths.py receiver --device cuda --iterations 8
    python bench/gpu_paths.py sync --device cuda --iterations 4
    python bench/gpu_paths.py resume --device cuda --iterations 6
    torchrun --standalone --nproc_per_node=1 bench/gpu_paths.py group --device cuda
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
    same = summary.get("replica_digest") == summary.get("published_digest") is not None
    ok = summary["version"] == args.iterations and summary.get("replica_version") == args.iterations and \
        not summary.get("error") and len(shapes) > 1 and same
    print(f"colocated: {'PASS' if ok else 'FAIL'} device={args.device} versions={summary['version']} "
          f"replica={summary.get('replica_version')} replica_weights={'as published' if same else 'DIFFER'} "
          f"batch_shapes={sorted(shapes)} "
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
    same = other.get("replica_digest") == lead.get("published_digest") is not None
    ok = proc.returncode == 0 and lead["version"] == args.iterations and \
        other.get("replica_version") == args.iterations and same
    print(f"receiver: {'PASS' if ok else 'FAIL'} device={args.device} versions={lead['version']} "
          f"rank1_replica={other.get('replica_version')} rank1_weights={'as published' if same else 'DIFFER'} "
          f"roles={lead['role']}/{other['role']} "
          f"visible={lead.get('cuda_visible_devices')}/{other.get('cuda_visible_devices')} "
          f"versions_per_s={lead['version'] / wall:.2f} (torchrun start included)")
    if not ok:
        print(proc.stderr[-3000:])
    return ok


def sync(args) -> bool:
    """Four sync-mode runs that must end with the same weights, bit for bit."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (before CUDA starts: deterministic cuBLAS)
    import torch

    from dvla.config import apply_overrides
    from dvla.config.presets import fast_reach
    from swimlane import Swimlane

    torch.use_deterministic_algorithms(True)
    digests = {}
    for driver in ("serial", "threads"):
        for streams in ("false", "true"):
            out = Path(tempfile.mkdtemp(prefix="gpu_paths_sync_"))
            cfg = apply_overrides(fast_reach(), [
                f"run.out_dir={out}", f"run.device={args.device}", f"run.iterations={args.iterations}",
                "run.progress=false", f"env.n_envs={args.envs}", f"env.image_size={args.image}", "swimlane.mode=sync",
                f"swimlane.driver={driver}", f"swimlane.cuda_streams={streams}", "swimlane.trace=false",
                "run.seed=7"])
            summary = Swimlane(cfg).run()
            digests[f"{driver}/streams={streams}"] = (summary["version"], summary.get("weights_digest"))
    ok = len(set(digests.values())) == 1 and all(v == args.iterations for v, _ in digests.values())
    print(f"sync: {'PASS' if ok else 'FAIL'} device={args.device} " +
          " ".join(f"{k}:v{v}:{(d or 'none')[:12]}" for k, (v, d) in digests.items()))
    return ok


def resume(args) -> bool:
    """SIGTERM a CPU run after its first update, continue it on ``--device``."""
    import signal

    out = Path(tempfile.mkdtemp(prefix="gpu_paths_resume_"))
    base = [sys.executable, "-m", "dvla.launch", "--preset", "fast_reach", f"run.out_dir={out}", "run.progress=false",
            f"env.n_envs={args.envs}", f"env.image_size={args.image}", "swimlane.trace=false",
            f"run.iterations={args.iterations}"]
    first = subprocess.Popen([*base, "run.device=cpu"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    lines = []
    for line in first.stdout:  # the first update's line: then stop it
        lines.append(line)
        if "iter 0:" in line:
            first.send_signal(signal.SIGTERM)
            break
    rest, _ = first.communicate(timeout=args.timeout)
    lines.append(rest)
    again = subprocess.run([*base, "--resume", f"run.device={args.device}"], cwd=ROOT, capture_output=True, text=True,
                           timeout=args.timeout)
    runs = sorted(p for p in out.iterdir() if p.is_dir())
    try:
        summary = json.loads((runs[-1] / "summary.json").read_text())
    except (IndexError, OSError, ValueError):
        print(f"resume: FAIL stopped with exit {first.returncode}, resumed with exit {again.returncode}\n"
              f"{''.join(lines)[-2000:]}\n{again.stdout[-2000:]}{again.stderr[-2000:]}")
        return False
    ok = first.returncode == 0 and again.returncode == 0 and summary["version"] == args.iterations and \
        summary.get("resumed_from", 0) >= 1
    print(f"resume: {'PASS' if ok else 'FAIL'} stopped on cpu (exit {first.returncode}), resumed on {args.device} "
          f"from update {summary.get('resumed_from')} to {summary['version']} (exit {again.returncode})")
    if not ok:
        print(again.stderr[-3000:])
    return ok


def group(args) -> bool:
    """Under torchrun: what a learner rank asks of the group the launcher makes for it
    (``cpu:gloo,cuda:nccl`` on a GPU), each checked: the weight broadcaster's publish, the
    gradient all-reduce (plain and masked), small all-reduces, an FSDP2 learner in bf16 with
    activation checkpointing, its checkpoint gathered from the shards, ``shutdown()``, and the
    abort path (a group torn down without its barrier)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "bench"))
    from learner_step import make_batch

    from dvla.algos import build_algorithm
    from dvla.algos.optim import all_reduce_small
    from dvla.config import AlgoConfig
    from dvla.distributed import init_from_env, shutdown
    from dvla.distributed.groups import allreduce_mean_grads, sum_over_group
    from dvla.distributed.sharding import checkpoint_activations, full_state_dict, shard_learner
    from dvla.policy import PolicySpec, build_policy
    from memory import runtime
    from planes.control import WeightBroadcaster, new_control_group

    device = torch.device(args.device)
    checks: dict[str, bool] = {}
    with runtime.serving(device) as rt:
        rank, world = init_from_env(device=args.device)
        backend = str(dist.get_backend_config())
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).to(device)
        bc = WeightBroadcaster(mlp, src=0, group=new_control_group(device=device), bucket_bytes=1024)
        if rank == 0:
            bc.publish(1)
            bc.shutdown()
        else:
            while bc.receive() >= 0:
                pass
        checks["publish"] = bc.version == 1
        params = list(mlp.parameters())
        for p in params:
            p.grad = torch.full_like(p, float(rank + 1))
        allreduce_mean_grads(params)
        checks["grad all-reduce"] = all(torch.allclose(p.grad, torch.full_like(p, (world + 1) / 2)) for p in params)
        counted = allreduce_mean_grads(params, masked=True, contributes=rank == 0)
        checks["masked all-reduce"] = counted == 1 and all(
            torch.allclose(p.grad, torch.full_like(p, (world + 1) / 2)) for p in params)
        checks["small all-reduces"] = all_reduce_small([1.0, 2.5], torch.float64, None, device) == [world, 2.5 * world] \
            and sum_over_group({"n": 1.0}) == {"n": float(world)}
        spec = PolicySpec((3, args.image, args.image), 8, 7, 1)
        policy = build_policy("token_vla", spec, {"size": "tiny", "n_bins": 256,
                                                  "vision": {"image_size": args.image}}).to(device)
        algo = build_algorithm(AlgoConfig(name="grpo", group_size=4, update_epochs=1, minibatches=1, lr=1e-4,
                                          precision="bf16", shard="fsdp"), policy)
        batch = make_batch(policy, 8, args.image, device)
        shard_learner(algo, dist.group.WORLD)
        wrapped = checkpoint_activations(algo.policy)
        stats = algo.update(batch, torch.Generator().manual_seed(0))
        rt.synchronize()
        checks["fsdp bf16 update"] = wrapped > 0 and all(
            v == v for v in stats.values() if isinstance(v, float))  # (NaN != NaN)
        whole = full_state_dict(algo.policy)
        names = {n for n, _ in policy.named_parameters()}
        checks["checkpoint from shards"] = names <= set(whole) and all(
            bool(torch.isfinite(v).all()) for v in whole.values() if v.is_floating_point())
        shutdown()
        checks["shutdown"] = not dist.is_initialized()
        init_from_env(device=args.device)  # again, then torn down as on an error path
        shutdown(barrier=False)
        checks["abort path"] = not dist.is_initialized() or "nccl" in backend
    ok = all(checks.values())
    print(f"group: {'PASS' if ok else 'FAIL'} rank {rank} of {world} on {backend}: " +
          ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()), flush=True)
    return ok


PATHS = {"colocated": colocated, "receiver": receiver, "sync": sync, "resume": resume, "group": group}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", choices=list(PATHS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--envs", type=int, default=32)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    return 0 if PATHS[args.path](args) else 1


if __name__ == "__main__":
    sys.exit(main())
