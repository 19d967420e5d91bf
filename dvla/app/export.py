"""``dvla export``: a run's trained policy written in the layout its checkpoint came in, for
the reference code to load (:mod:`dvla.models.pi0_export`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dvla.config import ConfigError
from dvla.state.checkpoint import CheckpointError
from dvla.state.rundir import resolve_run_arg

EXPORTERS = {"pi0_vla": "pi0"}  # the policies with an exporter, and what they export as


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dvla export", description="A run's newest weights in a reference layout: "
                                "pi0_vla as LeRobot's (model.safetensors, config.json, processor files copied from "
                                "the checkpoint it started from) or openpi's PyTorch layout.")
    p.add_argument("run_dir", help="a run directory (or a base directory: its latest run)")
    p.add_argument("--format", required=True, help="lerobot or openpi")
    p.add_argument("--out", required=True, help="the directory to write (made if missing)")
    args = p.parse_args(argv)
    try:
        from dvla.evaluation.score import load_policy
        from dvla.models.pi0_export import export_pi0

        run = resolve_run_arg(Path(args.run_dir))
        cfg, policy, stored = load_policy(run)
        if cfg.policy.name not in EXPORTERS:
            raise ConfigError(f"dvla export: {run} trained policy {cfg.policy.name!r}; exported are "
                              f"{', '.join(EXPORTERS)}")
        source = cfg.policy.options.get("pretrained_path")
        source = Path(source) if source else None
        if source is not None and source.is_file():
            source = source.parent
        written = export_pi0(policy, Path(args.out), args.format, source, policy.normalizer)
    except (ConfigError, CheckpointError, ValueError) as exc:
        print(f"dvla export: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"exported {stored.describe()} as {args.format} to {args.out}: {', '.join(written)}")
    return 0
