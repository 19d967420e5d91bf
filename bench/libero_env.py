"""LIBERO stepping cost: dvla's ``libero`` env against LIBERO's own env and raw MuJoCo.

Four ways to take the same number of env steps on one LIBERO task (``--suite``, ``--task``),
``--n-envs`` envs, random 7-D actions:

* ``mujoco``: raw physics, ``mj_step`` on each env's model for one control period (as many
  substeps as robosuite takes per action), no controller, no observation, no rendering;
* ``libero``: LIBERO's ``OffScreenRenderEnv.step`` (``ControlEnv`` with ``--no-render``) on
  each env in turn, in this process: robosuite's controller, observables and cameras;
* ``dvla``: :class:`dvla.envs.libero_env.LiberoEnv` with ``workers=0`` (the same envs in this
  process, plus dvla's batching, observation assembly and done bookkeeping);
* ``dvla_workers``: the same with ``--workers`` spawned MuJoCo processes;
* ``dvla_workers_chunk`` (with ``--chunk K``): the same, stepping chunks of K actions as a
  policy's decisions do, so that only each chunk's last step renders its cameras.

Settings alternate (the order rotates per repeat); printed: env steps/s per setting and its
ratio to ``libero`` and to ``mujoco`` (medians over repeats). ``--frame-ms 32,64,128`` instead
times one agent-view frame (robosuite's camera sensor, one env in this process) at each size,
the sizes alternating, and prints the median ms per frame and the ratio to the first size.

    python bench/libero_env.py --repeats 3 --steps 60
    python bench/libero_env.py --render --image-size 64 --wrist-size 64 --steps 20
    python bench/libero_env.py --render --image-size 64 --steps 24 --chunk 4
    python bench/libero_env.py --frame-ms 32,64,128
    python bench/libero_env.py --reset-cost --render --image-size 64 --repeats 5

``--reset-cost`` instead times one reset of one env (in this process, the cameras of
``--render``), the two ways an episode can start as a fresh env's does: dvla's (robosuite's
soft reset, the gripper's command put back: :class:`dvla.envs.libero_host.LiberoHost`) and a
hard reset (the model reloaded, as LIBERO's own evaluation scripts reset), alternating; the
median seconds of each and the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
import torch

from dvla.config import EnvConfig
from dvla.envs import make_env
from dvla.envs.libero_host import LiberoHost


def raw_rate(host: LiberoHost, steps: int, physics_only: bool, rng: np.random.Generator) -> float:
    """env steps/s of LIBERO's own envs (``physics_only``: their MuJoCo models, mj_step only)."""
    import mujoco

    host.reset([(j, 0) for j in range(len(host.envs))])
    envs = [e.env for e in host.envs]  # the robosuite envs
    substeps = int(round(envs[0].control_timestep / envs[0].model_timestep))
    actions = rng.uniform(-1, 1, (steps, len(envs), 7))
    t0 = time.perf_counter()
    for s in range(steps):
        for j, env in enumerate(envs):
            if physics_only:
                m, d = env.sim.model._model, env.sim.data._data
                for _ in range(substeps):
                    mujoco.mj_step(m, d)
            else:
                host.envs[j].step(actions[s, j])
    return steps * len(envs) / (time.perf_counter() - t0)


def dvla_rate(env, steps: int, rng: np.random.Generator, chunk: int = 1) -> float:
    env.reset()
    steps = -(-steps // chunk) * chunk
    actions = torch.from_numpy(rng.uniform(-1, 1, (steps // chunk, env.n_envs, chunk, 7))).float()
    t0 = time.perf_counter()
    for s in range(steps // chunk):
        env.step(actions[s])
    return steps * env.n_envs / (time.perf_counter() - t0)


def frame_ms(sizes: list[int], task: str, task_id: int, repeats: int, frames: int = 10) -> None:
    """Median ms of one agent-view frame at each size (the host's camera sensor, rendered
    as a live step renders it)."""
    hosts = {s: LiberoHost(task, [task_id], s, 0, True, 0, 0) for s in sizes}
    got: dict[int, list[float]] = {s: [] for s in sizes}
    try:
        for h in hosts.values():
            h.reset([(0, 0)])
        for i in range(repeats):
            for s in sizes[i % len(sizes):] + sizes[:i % len(sizes)]:
                env = hosts[s].envs[0].env
                camera = env._observables["agentview_image"]._sensor
                camera(env._obs_cache)  # (live after a reset)
                t0 = time.perf_counter()
                for _ in range(frames):
                    camera(env._obs_cache)
                got[s].append((time.perf_counter() - t0) / frames * 1000)
    finally:
        for h in hosts.values():
            h.close()
    med = {s: statistics.median(v) for s, v in got.items()}
    print("agent-view frame, median ms: " + ", ".join(f"{s} px {med[s]:.0f} ({med[s] / med[sizes[0]]:.2f}x)"
                                                       for s in sizes))


def reset_cost(args) -> None:
    opts = {"suite": args.suite, "task_ids": [args.task], "wrist_size": args.wrist_size, "settle_steps": 0}
    cfg = EnvConfig(name="libero", n_envs=1, episode_len=10 ** 6, image_size=args.image_size, render=args.render,
                    options=opts)
    env = make_env(cfg)
    host, got = env.hosts[0].host, {"soft": [], "hard": []}
    raw = host.envs[0]  # LIBERO's env (its ``env`` is robosuite's)
    try:
        host.reset([(0, 0)])  # warm-up
        for i in range(args.repeats):
            for how in (("soft", "hard") if i % 2 == 0 else ("hard", "soft")):
                raw.env.hard_reset = how == "hard"
                t0 = time.perf_counter()
                host.reset([(0, i % 50)])
                got[how].append(time.perf_counter() - t0)
        raw.env.hard_reset = False
    finally:
        env.close()
    med = {k: statistics.median(v) for k, v in got.items()}
    what = f"{args.image_size} px" if args.render else "physics only"
    print(f"reset of one env ({args.suite} task {args.task}, {what}, medians of {args.repeats}): soft + gripper "
          f"command {med['soft']:.3f} s, hard (model reloaded) {med['hard']:.3f} s; hard/soft {med['hard'] / med['soft']:.1f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="libero_spatial")
    p.add_argument("--task", type=int, default=0)
    p.add_argument("--n-envs", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60, help="env steps per env and setting")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--render", action="store_true", help="cameras on (agentview, and the wrist with --wrist-size)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--wrist-size", type=int, default=0)
    p.add_argument("--chunk", type=int, default=1, help="also step the workers' envs in chunks of this many actions")
    p.add_argument("--frame-ms", help="instead: ms per agent-view frame at these sizes (e.g. 32,64,128)")
    p.add_argument("--reset-cost", action="store_true", help="instead: seconds per reset, soft against hard")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.reset_cost:
        return reset_cost(args)
    if args.frame_ms:
        return frame_ms([int(x) for x in args.frame_ms.split(",")], args.suite, args.task, args.repeats)
    opts = {"suite": args.suite, "task_ids": [args.task], "wrist_size": args.wrist_size, "settle_steps": 0}
    cfg = EnvConfig(name="libero", n_envs=args.n_envs, episode_len=10 ** 6, image_size=args.image_size,
                    render=args.render, options=opts)
    envs = {"dvla": make_env(cfg),
            "dvla_workers": make_env(dataclasses.replace(cfg, options={**opts, "workers": args.workers}))}
    # LIBERO's own envs, driven directly for the baselines (rendering in every step: these
    # envs are only ever stepped one action at a time, after a reset that leaves them live)
    host = envs["dvla"].hosts[0].host
    names = ["mujoco", "libero", "dvla", "dvla_workers"]
    if args.chunk > 1:
        envs["dvla_workers_chunk"] = envs["dvla_workers"]
        names.append("dvla_workers_chunk")
    rate = (lambda n, steps: dvla_rate(envs[n], steps, rng, args.chunk if n.endswith("chunk") else 1)
            if n.startswith("dvla") else raw_rate(host, steps, n == "mujoco", rng))
    got: dict[str, list[float]] = {n: [] for n in names}
    rng = np.random.default_rng(0)
    try:
        for n in names:  # warm-up: numba kernels, first renders
            rate(n, 3)
        for i in range(args.repeats):
            order = names[i % len(names):] + names[:i % len(names)]
            for n in order:
                got[n].append(rate(n, args.steps))
            print(f"repeat {i}: " + ", ".join(f"{n} {got[n][-1]:.1f}" for n in names) + " env steps/s", flush=True)
    finally:
        for env in set(envs.values()):
            env.close()
    med = {n: statistics.median(v) for n, v in got.items()}
    what = f"{args.image_size} px" + (f" + wrist {args.wrist_size} px" if args.wrist_size else "") \
        if args.render else "physics only"
    print(f"median ({args.suite} task {args.task}, {args.n_envs} envs, {what}): "
          + ", ".join(f"{n} {med[n]:.1f}" for n in names) + " env steps/s; vs libero "
          + ", ".join(f"{n} {med[n] / med['libero']:.2f}x" for n in names if n != "libero")
          + "; vs raw mujoco " + ", ".join(f"{n} {med[n] / med['mujoco']:.3f}x" for n in names if n != "mujoco"))


if __name__ == "__main__":
    main()
