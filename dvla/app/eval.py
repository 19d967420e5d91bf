"""``dvla eval``: trained policies scored on fixed initial states (:mod:`dvla.evaluation`), one
run or several side by side, each result written beside its run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dvla.config import ConfigError, JobConfig, load_yaml
from dvla.evaluation import EvalSetup, evaluate
from dvla.evaluation.stats import comparisons, provenance, rate_cell, side_by_side
from dvla.state.checkpoint import CheckpointError
from dvla.state.rundir import resolve_run_arg


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
    if args.temperature is not None and (not args.sample or not args.temperature >= 0):
        raise ConfigError(f"--temperature {args.temperature}: a temperature >= 0, with --sample (the most likely "
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
                                                      "run's policy.temperature (0, a flow head's: noise at the "
                                                      "chain's start only, as pi0's own sampler and evaluation scripts)")
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
