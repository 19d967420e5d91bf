"""``dvla eval``: trained policies scored on fixed initial states, with the uncertainty of
each number, so that two evaluations of one checkpoint agree and two runs can be compared.

Every run is evaluated on the same episodes:

* LIBERO (``--suite``, default the run's own): every task of the suite runs its fixed initial
  states in order (the first ``--episodes``, 50 per task upstream), each episode for the
  suite's evaluation length (:data:`EVAL_STEPS` actions);
* any other env: one task (the env), ``--episodes`` episodes from an env seeded with
  ``--seed`` and reset in batches of ``--n-envs`` (default the first run's ``env.n_envs``),
  each for the first run's episode length in env steps.

Actions are the policy's most likely ones (``--sample`` draws them, from a generator seeded
with ``--seed``, at the run's ``policy.temperature`` or ``--temperature``). Each task's result
is successes/episodes, the success rate and its 95% Wilson score interval; with several runs (``dvla eval RUN_A RUN_B ...``) a side-by-side table
gives each run's difference from the first and the pooled two-proportion z-test's p-value,
overall and per task (:mod:`dvla.eval_stats`). Each run's result is written to
``RUN_DIR/eval.json`` (LIBERO: ``RUN_DIR/eval_<suite>.json``), or all of them to ``--out FILE``,
with the seeds and initial states used, the weights (path, version, digest), the git commit
of dvla and the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dvla.checkpoint import CheckpointError, weights_digest
from dvla.config import ConfigError, JobConfig, load_yaml
from dvla.eval_stats import comparisons, provenance, rate_cell, side_by_side, wilson
from dvla.init_weights import fit_policy, read_weights
from dvla.rundir import resolve_run_arg


@dataclass
class EvalSetup:
    """What every run is evaluated on (the same for all of them)."""

    episodes: int  # per task
    n_envs: int  # episodes run at once
    seed: int  # the env's (non-LIBERO: its initial states) and, with sample, the actions'
    deterministic: bool = True
    temperature: float | None = None  # with sample: None, each run's policy.temperature
    suite: str | None = None  # LIBERO
    tasks: list[int] | None = None  # LIBERO: None, every task of the suite
    workers: int = 0  # LIBERO: MuJoCo worker processes
    steps: int | None = None  # other envs: env steps per episode (None: the run's own episode length)


def load_policy(run: Path):
    """The run's config, its policy with its newest weights (``weights.safetensors`` or the
    newest valid checkpoint, whichever is newer) and what was read (:mod:`dvla.init_weights`)."""
    from dvla.envs import env_spec
    from dvla.policy import PolicySpec, build_policy  # (importing dvla registered the built-in policies)

    if not (run / "config.yaml").is_file():
        raise ConfigError(f"{run}: not a run directory (no config.yaml)")
    cfg = load_yaml(JobConfig(), run / "config.yaml")
    stored = read_weights(run, f"dvla eval {run}")
    spec = PolicySpec.for_env(env_spec(cfg.env), cfg.policy.action_chunk)
    policy = build_policy(cfg.policy.name, spec, cfg.policy.options, cfg.policy.temperature)
    fit_policy(policy, stored, cfg.policy.name, f"dvla eval {run}")
    return cfg, policy.eval(), stored


def _task_line(name: str, successes: int, done: int, seconds: float, what: str = "") -> str:
    lo, hi = wilson(successes, done)
    return (f"task {name}: {successes}/{done} = {successes / done:.2f}  95% CI [{lo:.2f}, {hi:.2f}]  "
            f"({seconds:.0f} s)  {what}").rstrip()


def evaluate_libero(cfg: JobConfig, policy, setup: EvalSetup, log=print) -> dict:
    """Success per task of ``setup.suite`` over its first ``setup.episodes`` fixed initial states."""
    from dvla.envs import make_env
    from dvla.envs.libero_env import EVAL_STEPS, SUITES, LiberoTasks
    from dvla.rollout import collect_episodes

    suite, episodes = setup.suite, setup.episodes
    if suite not in SUITES:
        raise ConfigError(f"--suite: {suite!r} is not one of {', '.join(SUITES)}")
    suite_tasks = LiberoTasks(suite)
    n_tasks = suite_tasks.n_tasks
    tasks = list(range(n_tasks)) if setup.tasks is None else setup.tasks
    bad = [t for t in tasks if not 0 <= t < n_tasks]
    if bad:
        raise ConfigError(f"--tasks: {bad} not in {suite} (0..{n_tasks - 1})")
    fewest = min(len(suite_tasks.init_states(t)) for t in tasks)
    if episodes > fewest:
        raise ConfigError(f"--episodes: {episodes} is more than the {fewest} fixed initial states a task has")
    n_envs = min(setup.n_envs, episodes)
    k = cfg.policy.action_chunk
    decisions = -(-EVAL_STEPS[suite] // k)
    gen = torch.Generator().manual_seed(setup.seed)
    per_task = {}
    for t in tasks:
        opts = {**cfg.env.options, "suite": suite, "task_ids": [t], "init_states": "sequential",
                "workers": setup.workers}
        env = make_env(dataclasses.replace(cfg.env, n_envs=n_envs, episode_len=decisions, options=opts),
                       seed=setup.seed)
        successes, done, start = 0, 0, time.perf_counter()
        try:
            while done < episodes:
                batch = collect_episodes(env, policy, decisions, generator=gen, deterministic=setup.deterministic)
                take = min(n_envs, episodes - done)  # the last batch may run states past the count
                successes += int(batch.success[:take].sum())
                done += take
        finally:
            env.close()
        per_task[str(t)] = {"instruction": env.instructions[0], "episodes": done, "successes": successes,
                            "init_states": list(range(done))}
        log(_task_line(str(t), successes, done, time.perf_counter() - start, env.instructions[0]))
    return {"env": "libero", "suite": suite, "decisions": decisions, "action_chunk": k, "tasks": per_task,
            "states": f"task t, episode i: the suite's fixed initial state i of task t (envs seeded {setup.seed})"}


def evaluate_env(cfg: JobConfig, policy, setup: EvalSetup, log=print) -> dict:
    """Success over ``setup.episodes`` episodes of the run's env, seeded ``setup.seed``."""
    from dvla.envs import make_env
    from dvla.rollout import collect_episodes

    k = cfg.policy.action_chunk
    decisions = -(-(setup.steps or cfg.env.episode_len * k) // k)
    n_envs = min(setup.n_envs, setup.episodes)
    gen = torch.Generator().manual_seed(setup.seed)
    env = make_env(dataclasses.replace(cfg.env, n_envs=n_envs, episode_len=decisions), seed=setup.seed)
    successes, done, start = 0, 0, time.perf_counter()
    try:
        while done < setup.episodes:
            batch = collect_episodes(env, policy, decisions, generator=gen, deterministic=setup.deterministic)
            take = min(n_envs, setup.episodes - done)
            successes += int(batch.success[:take].sum())
            done += take
    finally:
        env.close()
    name = cfg.env.name
    log(_task_line(name, successes, done, time.perf_counter() - start))
    return {"env": name, "decisions": decisions, "action_chunk": k,
            "tasks": {name: {"episodes": done, "successes": successes, "env_seed": setup.seed, "n_envs": n_envs}},
            "states": f"episode i: env i % {n_envs} after reset i // {n_envs} of the env seeded {setup.seed}"}


def evaluate(run: Path, setup: EvalSetup, log=print) -> dict:
    """One run's result: per task episodes, successes, rate and 95% interval, overall, and
    the weights, seeds and states it came from."""
    cfg, policy, stored = load_policy(run)
    if setup.temperature is not None:
        policy.temperature = setup.temperature
    torch.manual_seed(setup.seed)
    log(f"dvla eval: {run} (weights of version {stored.version}, {stored.path.name}) on "
        f"{setup.suite or cfg.env.name}")
    if setup.suite is not None:
        if cfg.env.name != "libero":
            raise ConfigError(f"dvla eval --suite {setup.suite}: the run trained on env {cfg.env.name!r}, not libero")
        result = evaluate_libero(cfg, policy, setup, log)
    else:
        result = evaluate_env(cfg, policy, setup, log)
    tasks = result["tasks"]
    for r in tasks.values():
        r["success_rate"] = r["successes"] / r["episodes"]
        r["ci95"] = list(wilson(r["successes"], r["episodes"]))
    episodes, successes = sum(r["episodes"] for r in tasks.values()), sum(r["successes"] for r in tasks.values())
    checkpoint = {"path": str(stored.path), "policy": stored.policy or cfg.policy.name, "version": stored.version,
                  "digest": weights_digest(policy)}
    return {"run": str(run), **result, "episodes_per_task": setup.episodes, "n_envs": min(setup.n_envs, setup.episodes),
            "seed": setup.seed, "deterministic": setup.deterministic,
            "temperature": None if setup.deterministic else policy.temperature, "episodes": episodes, "successes": successes,
            "success_rate": sum(r["success_rate"] for r in tasks.values()) / len(tasks),
            "ci95": list(wilson(successes, episodes)), "checkpoint": checkpoint, "checkpoint_version": stored.version}


def _setup(args, first: JobConfig) -> EvalSetup:
    """The episodes every run is evaluated on, from the options and the first run's config."""
    libero = first.env.name == "libero"
    if args.suite and not libero:
        raise ConfigError(f"dvla eval --suite {args.suite}: the run trained on env {first.env.name!r}, not libero")
    suite = (args.suite or first.env.options.get("suite", "libero_spatial")) if libero else None
    if args.tasks and not libero:
        raise ConfigError(f"--tasks: env {first.env.name!r} has one task (LIBERO suites have several)")
    episodes = args.episodes if args.episodes is not None else 50 if libero else 100
    n_envs = args.n_envs if args.n_envs is not None else 10 if libero else first.env.n_envs
    if episodes < 1 or n_envs < 1:
        raise ConfigError("--episodes and --n-envs must be >= 1")
    tasks = [int(t) for t in args.tasks.split(",")] if args.tasks else None
    if args.temperature is not None and (not args.sample or not args.temperature > 0):
        raise ConfigError(f"--temperature {args.temperature}: a temperature > 0, with --sample (the most likely "
                          "actions have none)")
    return EvalSetup(episodes=episodes, n_envs=n_envs, seed=args.seed, deterministic=not args.sample,
                     temperature=args.temperature, suite=suite,
                     tasks=tasks, workers=args.workers, steps=None if libero else
                     first.env.episode_len * first.policy.action_chunk)


def _same_env(runs: list[Path]) -> JobConfig:
    """The first run's config; a ConfigError when another run trained on another env (its
    states would not be the same)."""
    cfgs = []
    for run in runs:
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"{run}: not a run directory (no config.yaml)")
        cfgs.append(load_yaml(JobConfig(), run / "config.yaml"))
    first = cfgs[0]
    fixed = {"task_ids", "init_states", "workers"}  # what a LIBERO evaluation sets itself
    for run, cfg in zip(runs[1:], cfgs[1:]):
        a = (first.env.name, {k: v for k, v in first.env.options.items() if k not in fixed})
        b = (cfg.env.name, {k: v for k, v in cfg.env.options.items() if k not in fixed})
        if a != b:
            raise ConfigError(f"dvla eval: {run} trained on env {b[0]!r} with options {b[1]}, {runs[0]} on "
                              f"{a[0]!r} with {a[1]}: runs are compared on the same env's states")
    return first


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dvla eval", description="Success per task of trained policies on fixed "
                                "initial states (LIBERO's) or fixed seeds (other envs), with 95%% Wilson intervals; "
                                "several runs side by side with the difference from the first and its p-value "
                                "(pooled two-proportion z-test).")
    p.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="one or more runs (a base directory: its latest)")
    p.add_argument("--suite", help="LIBERO: libero_spatial, libero_object, libero_goal or libero_10 "
                                   "(default: the run's own)")
    p.add_argument("--tasks", help="LIBERO: comma-separated task ids (default: every task of the suite)")
    p.add_argument("--episodes", type=int, help="episodes per task (LIBERO: fixed initial states from the first; "
                                                "default 50; other envs: default 100)")
    p.add_argument("--n-envs", type=int, help="episodes run at once (default: LIBERO 10, else the first run's "
                                              "env.n_envs); part of what fixes the states of other envs")
    p.add_argument("--workers", type=int, default=0, help="LIBERO: MuJoCo worker processes (0: this process)")
    p.add_argument("--sample", action="store_true", help="sample actions (seeded with --seed) instead of the "
                                                         "most likely ones, at the run's policy.temperature")
    p.add_argument("--temperature", type=float, help="with --sample: sample at this temperature instead of the "
                                                      "run's policy.temperature")
    p.add_argument("--seed", type=int, default=0, help="the envs' seed (other envs: their initial states) and the "
                                                       "actions' with --sample (default 0)")
    p.add_argument("--out", help="write every run's result and the comparisons to this file (default: each run's "
                                 "own RUN_DIR/eval.json, LIBERO RUN_DIR/eval_<suite>.json)")
    args = p.parse_args(argv)
    runs = [resolve_run_arg(r) for r in args.run_dirs]
    say = lambda s: print(s, flush=True)  # noqa: E731
    try:
        setup = _setup(args, _same_env(runs))
        results = [evaluate(run, setup, log=say) for run in runs]
    except (ConfigError, CheckpointError, ValueError) as exc:
        print(f"dvla eval: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    compared = comparisons(results)
    record = provenance(argv)
    for r in results:
        say(f"{r['run']}: {setup.suite or r['env']}: overall {rate_cell(r['successes'], r['episodes'])} "
            f"(95% Wilson), mean over {len(r['tasks'])} task(s) {r['success_rate']:.3f}")
    if len(results) > 1:
        say(side_by_side(results, compared))
    name = f"eval_{setup.suite}.json" if setup.suite else "eval.json"
    if args.out:
        Path(args.out).write_text(json.dumps({**record, "runs": results, "comparisons": compared}, indent=1))
        say(f"wrote {args.out}")
        return 0
    for i, r in enumerate(results):
        out = Path(r["run"]) / name
        out.write_text(json.dumps({**r, **record, **({"compared_with_first": compared[i - 1]} if i else {})},
                                  indent=1))
        say(f"wrote {out}")
    return 0
