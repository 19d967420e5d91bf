"""Train on a gymnasium environment through dvla's gym adapter.

What this shows
---------------
* ``env.name=gym`` runs any ``gymnasium`` env (here the classic-control ``Pendulum-v1``,
  which ships with gymnasium, continuous 1-D torque) behind dvla's batched env interface
  (``dvla/envs/gym_adapter.py``): ``env.n_envs`` copies stepped as one vector env, actions
  in [-1, 1] rescaled to the env's ``Box`` bounds, the gym observation given to the
  policy as proprio. Pendulum has no camera, so the images are blank (kept tiny here)
  and the instruction is fixed (``env.options.instruction``).
* The job is built in Python from the public config dataclasses, then command-line style
  overrides are applied with ``dvla.config.apply_overrides``, and it runs in the swimlane.
* PPO (value head + GAE) by default, or GRPO (``--algo grpo``, critic-free, groups of
  ``algo.group_size`` episodes from the same initial state), printing the mean episode
  return of every update.

Pendulum's return per 200-step episode starts near -1300 (a random policy) and with the
defaults (100 PPO updates, about 2 minutes on 2 CPU cores) typically climbs to a few
hundred or better; the upright optimum is close to -150.

Run it
------
    python examples/gym_env.py                                  # writes runs/examples/gym_env
    python examples/gym_env.py --iterations 5 --out /tmp/gym
    python examples/gym_env.py --algo grpo env.n_envs=32
    python examples/gym_env.py --gym-id MountainCarContinuous-v0 env.episode_len=300

The adapter from the command line (any preset whose env.options are empty, e.g. debug;
``env.options`` overrides are merged into the preset's, and gym rejects fast_reach's):

    python -m dvla.launch --preset debug env.name=gym env.options.gym_id=Pendulum-v1 algo.name=ppo
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from tqdm import tqdm

from dvla import AlgoConfig, EnvConfig, PolicyConfig
from dvla.config import apply_overrides

# The adapter attaches one fixed instruction to every observation.
INSTRUCTIONS = {"Pendulum-v1": "swing the pendulum up and hold it upright",
                "MountainCarContinuous-v0": "drive the car up to the flag"}


def show(row: dict, total: int) -> None:
    """One line per learner update (the swimlane's ``on_update`` hook)."""
    # tqdm.write keeps the line clear of dvla's progress bar (run.progress).
    tqdm.write(f"update {row['iter'] + 1:4d}/{total}  return {row['return_mean']:9.2f}  "
               f"episode length {row['episode_len_mean']:5.1f}  loss {row['loss']:.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=100, help="learner updates (default: %(default)s)")
    parser.add_argument("--out", default="runs/examples/gym_env",
                        help="output directory (default: %(default)s)")
    parser.add_argument("--algo", choices=("ppo", "grpo"), default="ppo", help="default: %(default)s")
    parser.add_argument("--gym-id", default="Pendulum-v1", help="a gymnasium env id (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="extra dvla overrides, e.g. algo.lr=3e-4")
    args = parser.parse_args(argv)

    from dvla.config import presets
    from swimlane import Swimlane

    out = Path(args.out)
    cfg = presets.debug()  # only its run/swimlane defaults are kept; env, policy, algo are set here
    cfg.env = EnvConfig(
        name="gym",
        n_envs=8,  # GRPO: a multiple of algo.group_size
        episode_len=200,  # decisions per episode; Pendulum truncates at 200 steps anyway
        image_size=8,  # no camera: the blank image only has to be small
        options={"gym_id": args.gym_id, "instruction": INSTRUCTIONS.get(args.gym_id, f"solve {args.gym_id}")},
    )
    cfg.policy = PolicyConfig(
        name="tiny_vla",
        options={"head": "gaussian", "hidden_dim": 64, "vision_channels": 4, "embed_dim": 8},
    )
    cfg.algo = AlgoConfig(name=args.algo, lr=1e-3, gamma=0.9, update_epochs=10, minibatches=4, group_size=8)
    cfg = apply_overrides(cfg, [f"run.iterations={args.iterations}", f"run.out_dir={out}", "run.progress=true",
                                *args.overrides])
    cfg.validate()
    out.mkdir(parents=True, exist_ok=True)

    summary = Swimlane(cfg, on_update=functools.partial(show, total=cfg.run.iterations)).run()
    print(f"done: {summary['version']} {cfg.algo.name} updates on {args.gym_id}, "
          f"{summary['env_steps']} env steps; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
