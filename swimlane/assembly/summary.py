"""The end of a rank's run: its summary (``summary.json`` on rank 0, ``summary_rankN.json``
elsewhere, one ``attempts/attemptN.json`` per attempt), its trace, and rank 0's
``weights.safetensors``. The summary holds the rank's plan as ``--print-rank`` prints it and
the same text read back from what the rank built and ran (``plan``, ``built``).

Attempts are numbered in the order they started: rank 0 claims ``attemptN.json`` when its
lanes start (:func:`claim_attempt`, ``"state": "running"``) and replaces it with the
summary at the end. An attempt that was killed (SIGKILL, a lost host) leaves its claim
behind, and the next attempt marks it ``"killed"`` before claiming its own number."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from dvla.distributed.sharding import full_state_dict
from dvla.normalize import METADATA_KEY as NORM_KEY
from dvla.state.atomic_io import save_text
from dvla.state.checkpoint import all_finite, save_weights, weights_digest
from swimlane.assembly.parts import as_built
from swimlane.assembly.plan import format_plan
from swimlane.observation.trace import utilization

log = logging.getLogger("dvla.swimlane")


def whole_weights(swim) -> dict[str, Any] | None:
    """The learner's whole state dict, for the digest and weights.safetensors (gathered once
    from a sharded learner's shards: every learner calls this). None while the gradient lane
    may be mid-update, or when sharded learners stopped early (a gather could then wait for a
    learner that never joins it)."""
    if not hasattr(swim, "_whole"):
        ok = "gradient" not in swim.lanes_left_running
        if swim.cfg.sharded_learners:
            ok = ok and not swim.errors and not swim.state.stop_event.is_set()
        swim._whole = full_state_dict(swim.parts.policy) if ok else None
    return swim._whole


def summarize(swim, error: str | None = None) -> dict[str, Any]:
    s, p, lanes, sl = swim.state, swim.parts, swim.lanes, swim.cfg.swimlane
    plan = p.plan
    wall = time.perf_counter() - s.start_time
    util = utilization(s.tracer.spans)
    ran = list(swim.driver.threads) if swim.driver.threads else list(plan.lanes)  # (serial: all of them)
    summary: dict[str, Any] = {
        "mode": sl.mode, "rank": s.rank, "iterations": s.iterations, "version": s.version,
        "wall_s": wall, **s.ledger.counts,
        "weight_swaps": p.weights.swaps if p.weights is not None else 0,
        "lane_utilization": {k: round(v["utilization"], 4) for k, v in util.items()},
        "stopped_early": s.version < s.iterations, "time_limit_reached": s.time_up, "error": error,
        "lanes_left_running": swim.lanes_left_running,
        "restarts": s.restarts, "resumed_from": s.resumed_from, "totals": s.ledger.totals(),
        "host": plan.host, "role": plan.role,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # the rank's own GPU only
        "plan": format_plan(plan), "built": format_plan(as_built(p, ran)),
    }
    if sl.roles == "adaptive" and plan.learner:
        summary["learning_at_end"] = s.learning  # a candidate's role when the run ended
    if p.memory is not None:
        summary["memory"] = p.memory.summary()
        if p.host_pool is not p.memory.transient:
            summary["memory"]["transient_host"] = p.host_pool.stats().as_dict()
    if p.bc is not None:
        summary["broadcast_traffic"] = dict(p.bc.traffic)
    acting = p.policy  # the normalisation this rank acts (or learns) with, as a digest
    if plan.rollout:  # the newest weights this rank's inference replicas hold
        newest = max(range(2), key=lambda i: p.weights.versions[i])
        acting = p.weights.replicas[newest]
        summary["replica_version"] = p.weights.versions[newest]
        summary["replica_digest"] = weights_digest(p.weights.replicas[newest])
        summary["env_groups_active"] = lanes.sampling.active  # env groups that stepped at the end
        summary["chunks_by_group"] = [g.chunks for g in lanes.sampling.groups]  # and the chunks each sent
    summary["normalization"] = acting.normalizer.digest() if acting.normalizer is not None else None
    if s.world_size > 1 and plan.rollout:
        summary["data_route"] = {"learner": p.sink.learner,
                                 "transport": p.sink.sender.address.split("://")[0],  # as dialled
                                 "address": p.sink.sender.address}
    if s.rank == 0:
        summary["topology"] = p.topology.to_dict()
        summary["placement"] = p.placement.to_dict()
    if p.order.enabled:
        summary["collective_sequence"] = [f"{op} {v}" for op, v in p.order.sequence]
    if plan.learner:
        summary["chunk_accounting"] = swim.updates.chunk_accounting()
        summary["balance"] = p.balance.summary()
        if s.world_size > 1:
            c, rc = p.source.receiver.counters, p.source.receiver.cfg
            summary["receiver"] = {"received": c.received, "rejected": dict(c.rejected), "dropped": dict(c.dropped),
                                   "max_message_bytes": rc.max_message_bytes, "max_frame_bytes": rc.max_frame_bytes}
        steps = int(s.history[-1]["env_steps"]) if s.history else 0
        this_attempt = steps - s.ledger.carried_env_steps
        summary.update(env_steps=steps, env_steps_per_s=this_attempt / wall if wall > 0 else 0.0,
                       final_success_rate=s.history[-1]["success_rate"] if s.history else None)
        whole = whole_weights(swim)
        if whole is not None:  # the learner's weights, and as the replicas receive them
            summary["weights_digest"] = weights_digest(p.policy, whole)
            summary["published_digest"] = weights_digest(p.policy, {
                k: v.to(p.publish_dtype) if v.is_floating_point() else v for k, v in whole.items()})
    return summary


ATTEMPTS = "attempts"


def _write_json(path, data: dict[str, Any]) -> None:
    save_text(json.dumps(data, indent=2), path)


def _attempts(out_dir) -> dict[int, Any]:
    folder = out_dir / ATTEMPTS
    return {int(f.stem[7:]): f for f in folder.glob("attempt*.json") if f.stem[7:].isdigit()} \
        if folder.is_dir() else {}


def claim_attempt(out_dir, restarts: int, resumed_from: int | None = None) -> int:
    """Rank 0, as its lanes start: the number of this attempt (one more than any before),
    written down at once as ``attempts/attemptN.json`` (``"state": "running"``). An earlier
    attempt still ``running`` never ended: it is marked ``"killed"``."""
    (out_dir / ATTEMPTS).mkdir(parents=True, exist_ok=True)
    earlier = _attempts(out_dir)
    for k, path in earlier.items():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("state") == "running":
            log.warning("attempt %d ended without a summary (killed, or its host lost); recorded as killed", k)
            _write_json(path, {**data, "state": "killed", "noticed_unix": time.time()})
    n = max(earlier, default=-1) + 1
    _write_json(out_dir / ATTEMPTS / f"attempt{n}.json",
                {"attempt": n, "state": "running", "restarts": restarts, "resumed_from": resumed_from,
                 "started_unix": time.time()})
    return n


def write_summary(swim, error: str | None = None) -> dict[str, Any]:
    """The summary of this rank (returned), its trace, and on rank 0 the weights."""
    s, p = swim.state, swim.parts
    summary = summarize(swim, error)
    if swim.cfg.swimlane.trace:
        s.out_dir.mkdir(parents=True, exist_ok=True)
        name = "trace.json" if s.rank == 0 else f"trace_rank{s.rank}.json"
        s.tracer.save(s.out_dir / name, rank=s.rank, mode=swim.cfg.swimlane.mode, run_start=s.start_time,
                      run_start_unix=s.start_unix)
    if s.rank == 0:
        whole = whole_weights(swim)
        summary["last_good_version"] = s.last_good_version
        if whole is None:  # its weights may be mid-update (or in shards)
            log.warning("weights.safetensors not written: the gradient lane is still running, or the "
                        "sharded learners stopped early; the last checkpoint holds the weights")
        elif not all_finite(whole):
            log.warning("weights.safetensors not written: the weights of version %d hold NaN or inf; last good "
                        "version %d (the newest checkpoint in %s holds the last weights saved)", s.version,
                        s.last_good_version, s.out_dir / "checkpoints")
        else:
            norm = p.policy.normalizer  # with the weights, as dvla sft stores it
            save_weights(p.policy, s.out_dir / "weights.safetensors", s.version, whole,
                         **({NORM_KEY: norm.to_json()} if norm is not None else {}))
        (s.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        n = s.attempt if s.attempt is not None else claim_attempt(s.out_dir, s.restarts)
        summary["attempt"] = n
        _write_json(s.out_dir / ATTEMPTS / f"attempt{n}.json", {**summary, "state": "ended"})
    elif s.world_size > 1:
        s.out_dir.mkdir(parents=True, exist_ok=True)
        (s.out_dir / f"summary_rank{s.rank}.json").write_text(json.dumps(summary, indent=2))
    return summary
