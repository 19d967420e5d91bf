"""``dvla plan``: the planner's tables and its command line (:mod:`launch.planner` holds the
model)."""

from __future__ import annotations

import argparse
import math
import sys

from launch.placement import format_placement
from launch.planner import (
    BUCKET_BYTES,
    SHOW_PLACEMENT_MAX_RANKS,
    PlanReport,
    parse_count,
    parse_nodes,
    plan,
    rank_memory,
)

# -- text ----------------------------------------------------------------------------------------------------

def _fmt_time(s: float) -> str:
    if s <= 0:
        return "0"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 600:
        return f"{s:.2f} s"
    return f"{s / 60:.1f} min"


def _fmt_count(x: float) -> str:
    for unit, v in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= v:
            return f"{x / v:.3g}{unit}"
    return f"{x:.3g}"


def _fmt_bytes(b: float) -> str:
    for unit, v in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= v:
            return f"{b / v:.3g} {unit}"
    return f"{b:.0f} B"


def _fmt_speedup(r: PlanReport) -> str:
    if r.flat.time_s <= 0 and r.hier.time_s <= 0:
        return "-"
    return "inf" if math.isinf(r.speedup) else f"{r.speedup:.1f}x"


MODEL_TEXT = """\
model (alpha-beta): a message of m bytes on one link costs alpha + m/B; B_net per node NIC,
  shared by all streams leaving/entering a node at once; B_local per GPU (NVLink).
  flat: one NCCL broadcast over all ranks, a pipelined ring in torchrun order:
    alpha*(p-1) + S/B, B = B_net once the ring crosses a node (one stream per NIC each way).
  hier: source -> N leaders (T1), leader -> its g ranks (T2); a stage over k ranks costs
    min(alpha*(k-1) + S/B, ceil(log2 k)*(alpha + S/B)); bucketed forwarding overlaps them:
    T = max(T1,T2) + min(T1,T2)/buckets.
  weak scaling: a version is due every interval; throughput(N) ~ N / max(interval, T(N));
    efficiency = throughput(N) / (N * throughput(1)). All-reduce and data traffic not modelled."""


def _table(cols: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    return ["  ".join(c.rjust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths),
            *("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows)]


def format_table(reports: list[PlanReport]) -> str:
    """The summary table, then a second one with how the numbers are made up."""
    r0 = reports[0]
    head = (f"dvla plan: {_fmt_count(r0.params)} params x {r0.bytes_per_version / r0.params:g} B = "
            f"{_fmt_bytes(r0.bytes_per_version)} per weights version; {r0.gpus_per_node} ranks (GPUs) per node")
    lines = [head, ""]
    lines += _table(
        ["nodes", "ranks", "learners", "copies flat", "copies hier", "bcast flat", "bcast hier", "speed-up",
         "eff flat", "eff hier"],
        [[str(r.nodes), str(r.ranks), str(r.learners), str(r.flat.inter_node_copies),
          str(r.hier.inter_node_copies), _fmt_time(r.flat.time_s), _fmt_time(r.hier.time_s), _fmt_speedup(r),
          f"{r.efficiency_flat:.0%}", f"{r.efficiency_hier:.0%}"] for r in reports])
    lines += ["", "copies: inter-node copies of one weights version; bcast: modelled broadcast time per version;",
              "eff: modelled weak-scaling efficiency (throughput(N) / (N * throughput(1)))", ""]
    lines += _table(
        ["nodes", "inter-node flat", "inter-node hier", "ring hops", "hier T1", "hier T2",
         "buckets", "learner hosts", "tcp routes"],
        [[str(r.nodes), _fmt_bytes(r.flat.inter_node_bytes), _fmt_bytes(r.hier.inter_node_bytes),
          str(r.flat.rounds), _fmt_time(r.stage_s(1)), _fmt_time(r.stage_s(2)),
          str(r.hier.buckets), str(r.learner_hosts), f"{r.tcp_routes}/{r.rollout}"] for r in reports])
    lines += ["", "inter-node: bytes crossing hosts per version; ring hops: ranks the flat ring passes through;",
              "T1/T2: hierarchical stages (leaders, then local); tcp routes: rollout ranks whose chunks cross",
              "hosts"]
    notes = [f"{r.nodes} nodes: {n}" for r in reports for n in r.notes]
    if notes:
        lines += ["notes: " + "; ".join(notes)]
    return "\n".join(lines)


def format_memory(reports: list[PlanReport], trainable: float, kl: bool, publish_bytes: float) -> str:
    """Model memory per rank: replicated fp32 learners (``algo.shard=none``) against learners
    sharded over all learner ranks (``algo.shard=fsdp``), and a rollout rank's replicas."""
    rows = []
    for r in reports:
        p, colocated = r.params, r.colocate and r.rollout == r.ranks
        whole = rank_memory(p, rolls_out=colocated, trainable=trainable, kl=kl)
        sharded = rank_memory(p, learners=r.learners, sharded=True, rolls_out=colocated, trainable=trainable, kl=kl,
                              publish_bytes=publish_bytes)
        rollout = rank_memory(p, learns=False, rolls_out=True, publish_bytes=publish_bytes)
        rows.append([str(r.nodes), str(r.learners), _fmt_bytes(whole.total), _fmt_bytes(sharded.total),
                     _fmt_bytes(rank_memory(p, learns=False, rolls_out=True).total), _fmt_bytes(rollout.total),
                     _fmt_bytes(4 * trainable * p), _fmt_bytes(publish_bytes * trainable * p)])
    lines = [f"memory per rank (model only: weights, gradients, Adam, snapshot, replicas{', reference' if kl else ''}; "
             f"trainable share {trainable:g})", ""]
    lines += _table(["nodes", "learners", "learner fp32", "learner fsdp", "rollout fp32", f"rollout {publish_bytes:g} B",
                     "version fp32", f"version {publish_bytes:g} B"], rows)
    lines += ["", "fp32 (algo.shard=none, swimlane.publish_dtype=fp32): every learner a full fp32 copy (weights,",
              "gradients, two Adam moments), the source's fp32 snapshot, two fp32 inference replicas where it also",
              "rolls out. fsdp (algo.shard=fsdp): weights, gradients and moments split over the learners, each",
              "tensor gathered in turn into the source's snapshot; snapshot and replicas in",
              f"{publish_bytes:g} B per parameter. version: bytes per weights version after the first (frozen",
              "parameters are sent with the first version only). Activations are not counted."]
    return "\n".join(lines)


def format_assumptions(r: PlanReport, net_gbps: float, local_gbps: float, latency_us: float,
                       samples_per_node_s: float, batch_per_node: float, update_s: float) -> str:
    return (f"assumed: net {net_gbps:g} Gbit/s per node, local {local_gbps:g} Gbit/s per GPU, alpha "
            f"{latency_us:g} us; versions due every {_fmt_time(r.interval_s)} (update {update_s:g} s, "
            f"{batch_per_node:g} samples/node/version at {samples_per_node_s:g} samples/s/node)\n{MODEL_TEXT}")


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
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        nodes = parse_nodes(args.nodes)
        params = parse_count(args.params)
        reports = [plan(n, args.gpus_per_node, params, args.dtype_bytes, args.learner_fraction, args.net_gbps,
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


if __name__ == "__main__":
    sys.exit(main())
