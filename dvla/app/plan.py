"""``dvla plan``: placement and modelled weight-broadcast cost on a cluster (:mod:`launch.cluster_model`,
tables from :mod:`launch.plan_text`); ``--params POLICY[:KEY=VALUE,...]`` counts a registered
policy's parameters on the meta device."""

from __future__ import annotations

import argparse
import sys

from launch.cluster_model import BUCKET_BYTES, SHOW_PLACEMENT_MAX_RANKS, estimate, parse_count, parse_nodes
from launch.placement import format_placement
from launch.plan_text import format_assumptions, format_memory, format_table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dvla plan",
        description="Model the placement and per-version weight broadcast (one flat NCCL ring vs the "
                    "hierarchical node-leader tree) on a cluster, with weak-scaling efficiency.")
    p.add_argument("--nodes", nargs="+", default=["1,8,64,1024"],
                   help="node counts: one number or a list such as 1,8,64,1024 (default %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks (GPUs) per node (default 8)")
    p.add_argument("--params", default="7B", help="model parameters: 7e9, 7B, 500M, 1T (default 7B)")
    p.add_argument("--dtype-bytes", type=float, default=2, help="bytes per parameter sent (default 2)")
    p.add_argument("--learner-fraction", type=float, default=0.25, help="share of ranks that learn (default 0.25)")
    p.add_argument("--colocate", action="store_true", help="learners also run rollouts")
    p.add_argument("--net-gbps", type=float, default=400, help="inter-node Gbit/s per node (default 400)")
    p.add_argument("--local-gbps", type=float, default=2400, help="intra-node Gbit/s per GPU (default 2400)")
    p.add_argument("--latency-us", type=float, default=10, help="per-message latency alpha (default 10)")
    p.add_argument("--bucket-mb", type=float, default=BUCKET_BYTES / 2**20,
                   help="broadcast bucket size in MiB (default %(default)g)")
    p.add_argument("--samples-per-node-s", type=float, default=1000.0,
                   help="rollout samples per second per node (default 1000)")
    p.add_argument("--batch-per-node", type=float, default=1000.0,
                   help="samples each node contributes per learner update (default 1000)")
    p.add_argument("--update-s", type=float, default=1.0, help="learner time per update (default 1 s)")
    p.add_argument("--trainable", type=float, default=1.0,
                   help="share of the parameters that train (e.g. 0.01 for LoRA; default 1)")
    p.add_argument("--kl", action="store_true", help="GRPO with a KL term: learners hold a reference policy")
    p.add_argument("--show-placement", action="store_true",
                   help=f"print the placement table (clusters of at most {SHOW_PLACEMENT_MAX_RANKS} ranks)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = policy_params(list(sys.argv[1:] if argv is None else argv))
    except ValueError as exc:
        print(f"dvla plan: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        nodes = parse_nodes(args.nodes)
        params = parse_count(args.params)
        reports = [estimate(n, args.gpus_per_node, params, args.dtype_bytes, args.learner_fraction, args.net_gbps,
                        args.local_gbps, args.latency_us, colocate=args.colocate,
                        bucket_bytes=args.bucket_mb * 2**20, samples_per_node_s=args.samples_per_node_s,
                        batch_per_node=args.batch_per_node, update_s=args.update_s) for n in nodes]
    except ValueError as exc:
        parser.error(str(exc))
    if not 0 < args.trainable <= 1:
        parser.error(f"--trainable {args.trainable}: a share in (0, 1]")
    print(format_table(reports))
    print()
    print(format_memory(reports, args.trainable, args.kl, args.dtype_bytes))
    print()
    print(format_assumptions(reports[0], args.net_gbps, args.local_gbps, args.latency_us,
                             args.samples_per_node_s, args.batch_per_node, args.update_s))
    if args.show_placement:
        for r in reports:
            print()
            if r.placement is not None and r.ranks <= SHOW_PLACEMENT_MAX_RANKS:
                print(format_placement(r.placement, r.topology))
            else:
                print(f"placement for {r.nodes} nodes ({r.ranks} ranks): too large to list "
                      f"(at most {SHOW_PLACEMENT_MAX_RANKS} ranks)")
    return 0


def policy_params(argv: list[str]) -> list[str]:
    """``--params POLICY[:KEY=VALUE,...]`` (a registered policy and options) -> ``--params N``,
    its parameter count, from the model built on the meta device (no memory, no weights)."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--params" and i + 1 < len(argv) else None
        if value is None and arg.startswith("--params="):
            value = arg.split("=", 1)[1]
        if value is None or not value[:1].isalpha():
            continue
        import torch

        from dvla.config import ConfigError, parse_override
        from dvla.models import TinyVLA  # noqa: F401 (registers the built-in policies)
        from dvla.policy import PolicySpec, build_policy

        name, _, opts = value.partition(":")
        try:
            options = {k: v for kv in opts.split(",") if kv for k, v in parse_override(kv).items()}
            with torch.device("meta"):  # a 7B model's shapes, not its memory
                policy = build_policy(name, PolicySpec((3, 224, 224), 8, 7, 1), options)
        except (ConfigError, ValueError) as exc:
            raise ValueError(f"--params {value}: {exc}") from None
        count = str(sum(p.numel() for p in policy.parameters()))
        if arg == "--params":
            argv[i + 1] = count
        else:
            argv[i] = f"--params={count}"
        break
    return argv
