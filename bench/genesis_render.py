"""Camera cost on genesis-world's CPU renderer: the robot's collision shapes against its
visual meshes (``env.options.vis_mode``), and physics for scale.

Builds one ``genesis_reach`` env per mode in one process (same ``n_envs`` and image size),
then times rounds of one batched camera render per env, alternating which mode goes
first. Prints the median milliseconds per batch render of each mode, the ratio
visual/collision, and the median time of one control step's physics (IK + substeps,
camera off) for comparison.

    python bench/genesis_render.py --n-envs 8 --image-size 64 --rounds 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

import torch  # noqa: E402

from dvla.config import EnvConfig  # noqa: E402
from dvla.envs import make_env  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-envs", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()

    modes = ("collision", "visual")
    envs = {m: make_env(EnvConfig(name="genesis_reach", n_envs=args.n_envs, image_size=args.image_size,
                                  options={"vis_mode": m}), seed=0) for m in modes}
    for env in envs.values():
        env.reset()
        env.camera.render(rgb=True)  # first render sets up the context
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            t0 = time.perf_counter()
            envs[m].camera.render(rgb=True)
            times[m].append(time.perf_counter() - t0)
    for env in envs.values():
        env.close()

    physics_env = make_env(EnvConfig(name="genesis_reach", n_envs=args.n_envs, render=False), seed=0)
    physics_env.reset()
    action = torch.zeros(args.n_envs, 4)
    physics = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        physics_env._apply(action)
        physics.append(time.perf_counter() - t0)
    physics_env.close()

    med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    print(f"n_envs={args.n_envs} image={args.image_size}px rounds={args.rounds} (medians, ms per batch)")
    for m in modes:
        print(f"  render {m:<9} {med[m]:8.1f} ms  ({med[m] / args.n_envs:.1f} ms per image)")
    print(f"  physics step     {statistics.median(physics) * 1e3:8.1f} ms  "
          f"(IK + {physics_env.substeps} substeps, camera off)")
    print(f"visual/collision render time: {med['visual'] / med['collision']:.2f}")


if __name__ == "__main__":
    main()
