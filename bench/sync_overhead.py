"""Framework overhead of the synchronous loop on genesis-world.

Measures, in one run and with the same ``n_envs`` and camera settings:

1. raw genesis: ``scene.step()`` x substeps + camera render, no policy, no IK;
2. the env wrapper: ``BatchedEnv.step`` with random actions (adds IK and bookkeeping);
3. synchronous training (the serial driver: rollout with policy inference -> learn -> update,
   one after the other, in one thread).

and prints env steps/s for each and their ratios to raw genesis. The gap between 3
and 1 is what the asynchronous swimlane is meant to hide.

    PYOPENGL_PLATFORM=egl python bench/sync_overhead.py --n-envs 4 --iterations 3
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

import torch  # noqa: E402

from dvla.config import apply_overrides  # noqa: E402
from dvla.config.presets import genesis_reach  # noqa: E402
from swimlane import Swimlane  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-envs", type=int, default=4)
    ap.add_argument("--episode-len", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--no-render", action="store_true")
    args = ap.parse_args()

    cfg = apply_overrides(genesis_reach(), [
        f"env.n_envs={args.n_envs}", f"algo.group_size={args.n_envs // 2 or 1}",
        f"env.episode_len={args.episode_len}", f"env.image_size={args.image_size}",
        f"env.render={not args.no_render}", f"run.iterations={args.iterations}",
        "run.progress=false", "run.out_dir=runs/bench_sync_overhead", "policy.action_chunk=1",
        "swimlane.mode=sync", "swimlane.driver=serial", "swimlane.env_groups=1",
    ])
    trainer = Swimlane(cfg)
    env = trainer.envs[0]
    decisions = args.episode_len * args.iterations

    # 1. raw genesis
    env.reset()
    t0 = time.perf_counter()
    for _ in range(decisions):
        for _ in range(env.substeps):
            env.scene.step()
        if env.camera is not None:
            env.camera.render(rgb=True)
    raw = decisions * env.n_envs / (time.perf_counter() - t0)

    # 2. env wrapper with random actions (episodes restart like the trainer's)
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for i in range(decisions):
        if i % args.episode_len == 0:
            env.reset()
        env.step(torch.rand(env.n_envs, 1, env.spec.action_dim, generator=gen) * 2 - 1)
    wrapped = decisions * env.n_envs / (time.perf_counter() - t0)

    # 3. synchronous training (serial driver)
    summary = trainer.run()
    sync = summary["env_steps_per_s"]

    print(f"n_envs={args.n_envs} image={args.image_size if not args.no_render else 'off'} "
          f"decisions={decisions} torch_threads={torch.get_num_threads()}")
    print(f"raw genesis      {raw:9.1f} env steps/s   ratio 1.000")
    print(f"env wrapper      {wrapped:9.1f} env steps/s   ratio {wrapped / raw:.3f}")
    print(f"sync (serial)    {sync:9.1f} env steps/s   ratio {sync / raw:.3f}")


if __name__ == "__main__":
    main()
