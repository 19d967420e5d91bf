"""A rank's plan (swimlane/assembly/plan.py): what each role is made of, printed by --print-rank, and
the parts a live rank builds and the lanes it starts follow it."""

import pytest

from dvla.config import ConfigError, apply_overrides
from dvla.config.presets import debug, fast_reach
from launch.placement import place
from launch.topology import from_spec
from swimlane import Swimlane
from swimlane.assembly.plan import Broadcast, Route, format_plan, plan_rank, plans_for

# Four processes on two hosts, two learners: rank 0 learns and samples (colocated), rank 1
# learns only when colocate=false, ranks 2 and 3 only sample.
JOB = ["swimlane.topology=2x2", "swimlane.learner_ranks=2"]


def _plans(*overrides):
    return plans_for(apply_overrides(fast_reach(), [*JOB, *overrides]), 4)


def test_a_colocated_learner_runs_all_four_lanes_and_publishes():
    p = _plans()[0]
    assert p.role == "learner+rollout" and p.learner and p.rollout
    assert p.lanes == ("gradient", "broadcast", "inference", "sampling")
    assert p.broadcast == Broadcast("source", 0, "replicas+snapshot", "fp32")
    assert p.checkpoints == "write" and p.grad_sync == "fsdp"
    assert p.env_groups == p.env_groups_stepping == 2 and p.envs_per_group == 64
    assert p.chunks.routes == (Route(0, "ipc"),)  # its own chunks, over ipc to its own receiver
    assert 0 in p.chunks.senders and p.chunks.senders_elsewhere  # ranks on host1 send to it too
    assert p.groups.learners == (0, 1) and p.groups.backend == "gloo" and p.groups.stages is not None
    text = format_plan(p)
    for channel in ("requests", "replies", "snapshot", "weights"):
        assert f"channel:  {channel}" in text


def test_a_rollout_only_rank_receives_weights_and_sends_chunks_to_its_learner():
    plans = _plans("swimlane.colocate=false")
    p = plans[3]
    assert p.role == "rollout" and not p.learner
    assert p.lanes == ("broadcast", "inference", "sampling")
    # Host 1's leader (rank 2) forwards the weights to rank 3 (the hierarchical broadcast).
    assert p.broadcast == Broadcast("receive", 2, "replicas", "fp32")
    assert p.grad_sync == "none" and p.checkpoints == "none"
    assert p.chunks_to in (0, 1) and p.chunks.routes == (Route(p.chunks_to, "tcp"),) and not p.chunks.senders


def test_a_learner_only_rank_relays_weights_and_holds_no_envs_or_replicas():
    p = _plans("swimlane.colocate=false")[1]
    assert p.role == "learner" and not p.rollout
    assert p.lanes == ("gradient", "broadcast") and p.broadcast == Broadcast("relay", 0, "relay", "fp32")
    assert p.env_groups == 0 and p.chunks_to is None and p.checkpoints == "gather"
    assert "channel:  requests" not in format_plan(p) and p.pools.host is None


def test_adaptive_roles_average_gradients_over_the_learners_with_samples():
    """The product's wiring for swimlane.roles=adaptive: a masked mean (a learner sitting an
    update out is left out of the average), and every rollout rank starts sending to rank 0."""
    cfg = apply_overrides(fast_reach(), ["swimlane.topology=1x3", "swimlane.learner_ranks=2",
                                         "swimlane.roles=adaptive"])
    plans = plans_for(cfg, 3)
    assert [p.grad_sync for p in plans] == ["masked_mean", "masked_mean", "none"]
    assert all(p.chunks_to == 0 for p in plans)
    assert [lr.learner for lr in plans[2].chunks.routes] == [0, 1]  # a sender to every learner, rank 0 first
    fixed = plans_for(apply_overrides(cfg, ["swimlane.roles=fixed", "algo.shard=none"]), 3)
    assert [p.grad_sync for p in fixed] == ["mean", "mean", "none"]


def test_plan_rank_is_pure_and_its_text_names_every_part():
    cfg = fast_reach()
    topo = from_spec("1x1")
    p = plan_rank(cfg, 0, topo, place(topo, 1, True), "cpu")
    assert p == plan_rank(cfg, 0, topo, place(topo, 1, True), "cpu")
    text = format_plan(p)
    for word in ("learner+rollout", "gradient", "sampling", "chunks", "persistent", "replicas+snapshot"):
        assert word in text
    assert "pools:    none" in format_plan(plan_rank(apply_overrides(cfg, ["memory.enabled=false"]), 0, topo,
                                                       place(topo, 1, True), "cpu"))


@pytest.mark.parametrize("role,rank,extra,want", [
    ("colocated learner", 0, [], "learner+rollout"),
    ("rollout-only", 2, ["swimlane.colocate=false"], "rank 2 of 4 on host1: rollout"),
    ("learner-only", 1, ["swimlane.colocate=false"], "rank 1 of 4 on host0: learner, device cpu"),
])
def test_print_rank_shows_each_role(role, rank, extra, want, launcher, tmp_path):
    out = launcher.run("dvla.launch", ["--preset", "fast_reach", *JOB, *extra, "run.device=cpu", "--print-rank",
                                       str(rank)], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert want in out.stdout and out.stdout.count("\nrank ") == 0  # one rank's block
    assert "lanes:" in out.stdout and "channel:" in out.stdout and "pools:" in out.stdout


def test_print_rank_refuses_a_rank_outside_the_world(launcher, tmp_path):
    out = launcher.run("dvla.launch", ["--preset", "debug", "--print-rank", "3"], cwd=tmp_path)
    assert out.returncode == 2 and "no rank 3 in a world of 1" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_live_rank_builds_and_starts_what_its_plan_names(tmp_path):
    cfg = apply_overrides(debug(), [f"run.out_dir={tmp_path}", "run.iterations=2"])
    swim = Swimlane(cfg)
    assert swim.plan == plans_for(cfg, 1)[0]
    assert list(swim.lanes.threads()) == list(swim.plan.lanes)
    assert len(swim.envs) == swim.plan.env_groups and swim.parts.weights is not None
    assert swim.parts.snapshot is not None
    summary = swim.run()
    assert set(summary["lane_utilization"]) == set(swim.plan.lanes)
    assert summary["built"] == summary["plan"] == format_plan(swim.plan)


@pytest.mark.parametrize("overrides, problem", [
    (["swimlane.topology=1x3", "swimlane.colocate=false"],
     r"learner rank\(s\) 1 would get chunks from no rollout rank \(1 rollout rank\(s\) for 2 learners\)"),
    (["data_plane.require_auth=true"],
     r"data_plane.require_auth: the chunks of rank\(s\) 2, 3 would cross tcp without authentication; make keys"),
])
def test_a_job_its_placement_cannot_run_is_refused_at_the_plan(overrides, problem):
    """Refused on every rank alike, before anything is built: a learner that no rollout rank
    sends to, and ``require_auth`` where chunks would cross tcp without keys."""
    with pytest.raises(ConfigError, match=problem):
        _plans(*overrides)
    assert _plans()  # the job itself plans
