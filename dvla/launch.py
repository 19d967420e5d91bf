"""Entry point: parse the config, set up the process group, train, tear down.

    python -m dvla.launch --preset debug run.iterations=5
    torchrun --standalone --nproc_per_node=2 -m dvla.launch --preset fast_reach

Overrides are ``KEY=VALUE`` with dotted keys (``--env.n_envs=32`` works too); values
are parsed as YAML. ``--config FILE.yaml`` is applied before the overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback

import torch

from dvla.config import ConfigError, apply_overrides, load_yaml
from dvla.distributed import init_from_env, shutdown
from dvla.presets import DEFAULT_PRESET, PRESETS, get_preset


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dvla.launch",
        description="Train a VLA policy with RL. Positional KEY=VALUE arguments override the config.",
    )
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"one of: {', '.join(PRESETS)} (default: %(default)s)")
    p.add_argument("--config", help="YAML file applied on top of the preset")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in "
                   "run.out_dir/checkpoints (same as run.resume=true)")
    return p


def parse_config(argv: list[str] | None = None):
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if "=" not in a]
    if bad:
        parser.error(f"unrecognised arguments {bad}; overrides look like env.n_envs=8")
    cfg = get_preset(args.preset)
    if args.config:
        cfg = load_yaml(cfg, args.config)
    cfg = apply_overrides(cfg, rest)
    if args.resume:
        cfg.run.resume = True
    cfg.validate()
    return args, cfg


def main(argv: list[str] | None = None) -> int:
    try:
        args, cfg = parse_config(argv)
    except ConfigError as exc:
        print(f"dvla: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    from swimlane import Swimlane

    rank, world = init_from_env()
    try:
        if world > 1 and cfg.run.device in ("auto", "cuda") and torch.cuda.is_available():
            cfg.run.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        lanes = Swimlane(cfg, rank=rank, world_size=world)
        stopped = []

        def on_sigterm(*_):  # torchrun stops the group this way when a peer has died
            stopped.append(True)
            lanes.request_stop()

        signal.signal(signal.SIGTERM, on_sigterm)
        summary = lanes.run()
    except BaseException:
        if world == 1:
            raise
        # A peer may be blocked in a collective that can never complete now: report and
        # leave without the teardown barrier (torchrun then stops the other ranks).
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if rank == 0:
        print(json.dumps(summary), flush=True)
    if stopped and world > 1:
        # Stopped from outside: a peer may be gone, so no teardown barrier.
        sys.stdout.flush()
        os._exit(0)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
