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
import sys

import torch
import torch.distributed as dist

from dvla.config import ConfigError, apply_overrides, load_yaml
from dvla.presets import DEFAULT_PRESET, PRESETS, get_preset


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dvla.launch",
        description="Train a VLA policy with RL. Positional KEY=VALUE arguments override the config.",
    )
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"one of: {', '.join(PRESETS)} (default: %(default)s)")
    p.add_argument("--config", help="YAML file applied on top of the preset")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
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
    cfg.validate()
    return args, cfg


def _init_distributed() -> tuple[int, int]:
    """Join the process group torchrun describes in the environment (if any)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


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
    from dvla.trainer import SyncTrainer

    rank, world = _init_distributed()
    try:
        if world > 1 and cfg.run.device in ("auto", "cuda") and torch.cuda.is_available():
            cfg.run.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        summary = SyncTrainer(cfg, rank=rank, world_size=world).run()
        if rank == 0:
            print(json.dumps(summary), flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
