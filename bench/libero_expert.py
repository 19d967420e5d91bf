"""Success of the scripted LIBERO expert (:mod:`dvla.envs.libero_expert`) per task.

Each task of ``--suite`` (or ``--tasks``) runs its fixed initial states in order, from the
first (``--episodes`` of them, 50 upstream: the states ``dvla eval`` scores a policy on),
through dvla's :class:`LiberoEnv` (physics only, no cameras), for the suite's evaluation
length (``EVAL_STEPS``: 220 actions for libero_spatial); an episode stops at its success.
Printed: successes per task with a 95% Wilson interval, the mean actions to success, the
time per task and the wall time.

    python bench/libero_expert.py --tasks 0 --episodes 5
    python bench/libero_expert.py --episodes 50
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dvla.config import EnvConfig
from dvla.envs import make_env
from dvla.envs.libero_env import EVAL_STEPS, LiberoTasks
from dvla.evaluation.stats import wilson
from dvla.envs.libero_expert import LiberoExpert, run_episodes


def run_task(suite: str, task: int, episodes: int, n_envs: int, workers: int, steps: int, seed: int) -> dict:
    n_envs = min(n_envs, episodes)
    opts = {"suite": suite, "task_ids": [task], "init_states": "sequential", "workers": workers}
    env = make_env(EnvConfig(name="libero", n_envs=n_envs, episode_len=steps, render=False, options=opts), seed=seed)
    expert = LiberoExpert(env)
    wins, used, done, start = 0, [], 0, time.perf_counter()
    try:
        while done < episodes:  # states done, done + 1, ... (sequential, one per env)
            success, n = run_episodes(env, expert, steps)
            take = min(n_envs, episodes - done)
            wins += int(success[:take].sum())
            used += [n] if n_envs == 1 and bool(success[0]) else []
            done += take
    finally:
        env.close()
    lo, hi = wilson(wins, done)
    return {"instruction": env.instructions[0], "episodes": done, "successes": wins, "success_rate": wins / done,
            "wilson95": [lo, hi], "mean_steps_to_success": sum(used) / len(used) if used else None,
            "seconds": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="libero_spatial")
    p.add_argument("--tasks", help="comma-separated task ids (default: every task of the suite)")
    p.add_argument("--episodes", type=int, default=50, help="fixed initial states per task, from the first")
    p.add_argument("--n-envs", type=int, default=1, help="episodes at once (1: each stops at its success)")
    p.add_argument("--workers", type=int, default=0, help="MuJoCo worker processes (0: this process)")
    p.add_argument("--steps", type=int, help="actions per episode (default: the suite's EVAL_STEPS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    torch.set_num_threads(1)
    tasks = LiberoTasks(args.suite)
    ids = [int(t) for t in args.tasks.split(",")] if args.tasks else list(range(tasks.n_tasks))
    for t in ids:
        tasks.check(t)
    steps = args.steps or EVAL_STEPS[args.suite]
    start, results = time.perf_counter(), {}
    print(f"libero expert on {args.suite}: tasks {ids}, {args.episodes} fixed initial states each, "
          f"{steps} actions at most", flush=True)
    for t in ids:
        r = results[t] = run_task(args.suite, t, args.episodes, args.n_envs, args.workers, steps, args.seed)
        lo, hi = r["wilson95"]
        mean = f"{r['mean_steps_to_success']:.0f}" if r["mean_steps_to_success"] else "-"
        print(f"task {t}: {r['successes']}/{r['episodes']} = {r['success_rate']:.2f}  95% [{lo:.2f}, {hi:.2f}]  "
              f"{mean} actions to success  ({r['seconds']:.0f} s)  {r['instruction']}", flush=True)
    wins, n = sum(r["successes"] for r in results.values()), sum(r["episodes"] for r in results.values())
    lo, hi = wilson(wins, n)
    wall = time.perf_counter() - start
    print(f"all: {wins}/{n} = {wins / n:.3f}  95% [{lo:.3f}, {hi:.3f}]  worst task "
          f"{min(r['success_rate'] for r in results.values()):.2f}  wall {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": args.suite, "steps": steps, "tasks": results, "wall_s": wall}, f, indent=1)


if __name__ == "__main__":
    main()
