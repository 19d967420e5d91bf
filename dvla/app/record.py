"""``dvla record``: a run's policy or a scripted expert in an env, its episodes written as a
LeRobot dataset (:mod:`dvla.datasets.record`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from dvla.datasets.core import DatasetError
from dvla.datasets.record import EXPERT_ENVS, EXPERTS, FPS, LIBERO_ACTION, LIBERO_STATE, PolicyActor, record


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dvla record", description="Run a run's policy or a scripted expert in an "
                                "env and write the episodes as a LeRobot v3.0 dataset.")
    p.add_argument("args", nargs="*", metavar="RUN_DIR | KEY=VALUE", help="a run directory (its policy and env) "
                   "and/or config overrides (env.n_envs=4, env.options.task_ids=[2], ...)")
    p.add_argument("--expert", help=f"a scripted expert instead of a policy: {', '.join(sorted(EXPERTS))}")
    p.add_argument("--preset", help="with --expert: the preset whose env to use (default fast_reach)")
    p.add_argument("--episodes", type=int, required=True)
    p.add_argument("--out", required=True, help="the new dataset's directory")
    p.add_argument("--success-only", action="store_true", help="keep successful episodes only")
    p.add_argument("--max-steps", type=int, help="actions per episode (default: LIBERO's evaluation length, "
                                                 "else env.episode_len x policy.action_chunk)")
    p.add_argument("--max-tries", type=int, help="with --success-only: episodes to try at most (default 10 x N)")
    p.add_argument("--fps", type=int, help="frames per second in the metadata (default: LIBERO 20, else 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", action="store_true", help="sample the policy's actions (default: most likely)")
    a = p.parse_args(argv)
    from dvla.config import ConfigError, apply_overrides
    from dvla.envs import make_env

    runs = [x for x in a.args if "=" not in x]
    overrides = [x for x in a.args if "=" in x]
    env = None
    try:
        if a.episodes < 1:
            raise ConfigError("--episodes must be >= 1")
        if bool(runs) == bool(a.expert) or len(runs) > 1:
            raise ConfigError("give one RUN_DIR (its policy) or --expert NAME, not both or neither")
        torch.manual_seed(a.seed)
        if a.expert:
            from dvla.config.presets import get_preset

            if a.expert not in EXPERTS:
                raise ConfigError(f"--expert: unknown expert {a.expert!r}; registered: {', '.join(sorted(EXPERTS))}")
            cfg = apply_overrides(get_preset(a.preset or "fast_reach"), overrides)
            if EXPERT_ENVS[a.expert] and cfg.env.name not in EXPERT_ENVS[a.expert]:
                raise ConfigError(f"--expert {a.expert} drives env {' or '.join(EXPERT_ENVS[a.expert])}, not "
                                  f"{cfg.env.name!r} (--preset {a.preset})")
            env = make_env(cfg.env, seed=a.seed)
            actor, source = EXPERTS[a.expert](env), f"expert {a.expert}"
        else:
            from dvla.evaluation import load_policy
            from dvla.state.rundir import resolve_run_arg

            if a.preset:
                raise ConfigError("--preset goes with --expert (a run brings its own config)")
            run = resolve_run_arg(runs[0])
            cfg, policy, stored = load_policy(run)
            cfg = apply_overrides(cfg, overrides)
            env = make_env(cfg.env, seed=a.seed)
            actor = PolicyActor(policy, not a.sample, torch.Generator().manual_seed(a.seed))
            source = f"policy of {run} (weights version {stored.version})"
        libero = cfg.env.name == "libero"
        if libero:
            from dvla.envs.libero_env import EVAL_STEPS

            steps = a.max_steps or EVAL_STEPS[env.tasks.name]
        else:
            steps = a.max_steps or cfg.env.episode_len * cfg.policy.action_chunk
        extra = {"source": source, "env": dataclasses.asdict(cfg.env), "command": "dvla record " + " ".join(argv),
                 "conventions": "images upright (LIBERO: rotated 180 degrees from robosuite's render); "
                                "LIBERO gripper action -1 open, +1 close"}
        names = {"state_names": LIBERO_STATE, "action_names": LIBERO_ACTION} if libero else {}
        info = record(env, actor, a.out, a.episodes, steps, a.fps or FPS.get(cfg.env.name, 10), a.success_only,
                      a.max_tries, robot_type="panda" if libero else cfg.env.name, extra_info=extra, **names)
    except (ConfigError, DatasetError, ValueError, RuntimeError) as exc:  # RuntimeError: CheckpointError
        print(f"dvla record: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    finally:
        if env is not None:
            env.close()
    print(f"wrote {a.out}: {info['total_episodes']} episodes, {info['total_frames']} frames, "
          f"LeRobot {info['codebase_version']}")
    return 0
