"""``dvla plan``'s tables (:mod:`launch.cluster_model` holds the model; the command is
:mod:`dvla.app.plan`)."""

from __future__ import annotations

import math

from launch.cluster_model import (
    ClusterEstimate,
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


def _fmt_speedup(r: ClusterEstimate) -> str:
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


def format_table(reports: list[ClusterEstimate]) -> str:
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


def format_memory(reports: list[ClusterEstimate], trainable: float, kl: bool, publish_bytes: float) -> str:
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


def format_assumptions(r: ClusterEstimate, net_gbps: float, local_gbps: float, latency_us: float,
                       samples_per_node_s: float, batch_per_node: float, update_s: float) -> str:
    return (f"assumed: net {net_gbps:g} Gbit/s per node, local {local_gbps:g} Gbit/s per GPU, alpha "
            f"{latency_us:g} us; versions due every {_fmt_time(r.interval_s)} (update {update_s:g} s, "
            f"{batch_per_node:g} samples/node/version at {samples_per_node_s:g} samples/s/node)\n{MODEL_TEXT}")
