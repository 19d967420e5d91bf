"""Trained policies scored on fixed initial states, with the uncertainty of
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
overall and per task (:mod:`dvla.evaluation.stats`). Each run's result is written to
``RUN_DIR/eval.json`` (LIBERO: ``RUN_DIR/eval_<suite>.json``), or all of them to ``--out FILE``,
with the seeds and initial states used, the weights (path, version, digest), the git commit
of dvla and the command line.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dvla.state.checkpoint import weights_digest
from dvla.config import ConfigError, JobConfig, load_yaml
from dvla.evaluation.stats import wilson
from dvla.state.init_weights import fit_policy, read_weights


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
    newest valid checkpoint, whichever is newer) and what was read (:mod:`dvla.state.init_weights`)."""
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
