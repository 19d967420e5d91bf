"""``dvla eval``: a trained policy on a benchmark suite, scored as papers score it.

For LIBERO, every task of the suite runs its fixed initial states in order (50 per task
upstream), each episode for the suite's evaluation length (:data:`EVAL_STEPS` actions),
with the policy's most likely actions (``--sample`` draws them instead). The result is the
success rate per task and their mean, printed and written to ``RUN_DIR/eval_<suite>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from dvla.checkpoint import CheckpointError, CheckpointManager, section
from dvla.config import ConfigError, JobConfig, load_yaml


def load_policy(run: Path):
    """The run's config and its policy with the newest valid checkpoint's weights."""
    from dvla.envs import env_spec
    from dvla.policy import PolicySpec, build_policy  # (importing dvla registered the built-in policies)

    cfg = load_yaml(JobConfig(), run / "config.yaml")
    ck = CheckpointManager(run / "checkpoints").load_latest()
    if ck is None:
        raise CheckpointError(f"{run}: no checkpoint to evaluate (run.save_every=0?)")
    spec = PolicySpec.for_env(env_spec(cfg.env), cfg.policy.action_chunk)
    policy = build_policy(cfg.policy.name, spec, cfg.policy.options)
    try:
        policy.load_state_dict(section(ck.tensors, "policy/"))
    except RuntimeError as exc:
        raise CheckpointError(f"{ck.path}: does not fit policy {cfg.policy.name!r}: "
                              f"{str(exc).splitlines()[0]}") from None
    return cfg, policy.eval(), ck.step


def evaluate_libero(cfg: JobConfig, policy, suite: str, tasks: list[int] | None = None, episodes: int = 50,
                    n_envs: int = 10, workers: int = 0, deterministic: bool = True, seed: int = 0,
                    log=print) -> dict:
    """Success per task of ``suite`` over its first ``episodes`` fixed initial states."""
    from dvla.envs import make_env
    from dvla.envs.libero_env import EVAL_STEPS, SUITES, LiberoTasks
    from dvla.rollout import collect_episodes

    if suite not in SUITES:
        raise ConfigError(f"--suite: {suite!r} is not one of {', '.join(SUITES)}")
    if cfg.env.name != "libero":
        raise ConfigError(f"dvla eval --suite {suite}: the run trained on env {cfg.env.name!r}, not libero")
    suite_tasks = LiberoTasks(suite)
    n_tasks = suite_tasks.n_tasks
    tasks = list(range(n_tasks)) if tasks is None else tasks
    bad = [t for t in tasks if not 0 <= t < n_tasks]
    if bad:
        raise ConfigError(f"--tasks: {bad} not in {suite} (0..{n_tasks - 1})")
    fewest = min(len(suite_tasks.init_states(t)) for t in tasks)
    if episodes > fewest:
        raise ConfigError(f"--episodes: {episodes} is more than the {fewest} fixed initial states a task has")
    n_envs = min(n_envs, episodes)
    k = cfg.policy.action_chunk
    decisions = -(-EVAL_STEPS[suite] // k)
    gen = torch.Generator().manual_seed(seed)
    per_task = {}
    for t in tasks:
        opts = {**cfg.env.options, "suite": suite, "task_ids": [t], "init_states": "sequential", "workers": workers}
        env = make_env(dataclasses.replace(cfg.env, n_envs=n_envs, episode_len=decisions, options=opts), seed=seed)
        successes, done, start = 0, 0, time.perf_counter()
        try:
            while done < episodes:
                batch = collect_episodes(env, policy, decisions, generator=gen, deterministic=deterministic)
                take = min(n_envs, episodes - done)  # the last batch may run states past the count
                successes += int(batch.success[:take].sum())
                done += take
        finally:
            env.close()
        per_task[t] = {"instruction": env.instructions[0], "episodes": done, "successes": successes,
                       "success_rate": successes / done}
        log(f"task {t}: {successes}/{done} = {successes / done:.2f}  ({time.perf_counter() - start:.0f} s)  "
            f"{env.instructions[0]}")
    mean = sum(r["success_rate"] for r in per_task.values()) / len(per_task)
    return {"suite": suite, "episodes_per_task": episodes, "decisions": decisions, "action_chunk": k,
            "deterministic": deterministic, "tasks": per_task, "success_rate": mean}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dvla eval", description="Success per task of a trained policy on a "
                                "benchmark suite's fixed initial states (as papers report it).")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--suite", required=True, help="libero_spatial, libero_object, libero_goal or libero_10")
    p.add_argument("--tasks", help="comma-separated task ids (default: every task of the suite)")
    p.add_argument("--episodes", type=int, default=50, help="initial states per task, from the first (default 50)")
    p.add_argument("--n-envs", type=int, default=10, help="episodes run at once")
    p.add_argument("--workers", type=int, default=0, help="MuJoCo worker processes (0: this process)")
    p.add_argument("--sample", action="store_true", help="sample actions instead of the most likely ones")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    try:
        tasks = [int(t) for t in args.tasks.split(",")] if args.tasks else None
        if args.episodes < 1 or args.n_envs < 1:
            raise ConfigError("--episodes and --n-envs must be >= 1")
        cfg, policy, step = load_policy(run)
        print(f"dvla eval: {run} (checkpoint of version {step}) on {args.suite}", flush=True)
        result = evaluate_libero(cfg, policy, args.suite, tasks, args.episodes, args.n_envs, args.workers,
                                 not args.sample, args.seed, log=lambda s: print(s, flush=True))
    except (ConfigError, CheckpointError, ValueError) as exc:
        print(f"dvla eval: error: {exc}", file=sys.stderr)
        return 2
    out = run / f"eval_{args.suite}.json"
    out.write_text(json.dumps({**result, "checkpoint_version": step}, indent=1))
    print(f"{args.suite}: mean success {result['success_rate']:.3f} over {len(result['tasks'])} task(s); {out}")
    return 0
