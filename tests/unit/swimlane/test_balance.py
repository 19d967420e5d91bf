"""Imbalance between rollout ranks (swimlane/adaptation/balance.py): what the learners measure, who is
named a straggler, the plan (shares and env groups moved) and how it travels and applies."""

import pytest

from swimlane.lanes.admission import Admission
from swimlane.adaptation.balance import HEADROOM, NO_PLAN, Rebalancer, Rebalancing, stragglers
from swimlane.observation.throughput import Throughput


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_throughput_counts_per_rank_and_group_over_its_window():
    clock = Clock()
    tp = Throughput(window_s=10.0, clock=clock)
    tp.add({"rank": 1, "group": 0, "sample_s": 2.0}, steps=100, dropped=False)
    tp.add({"rank": 1, "group": 1, "sample_s": 2.0}, steps=100, dropped=True)
    clock.t = 5.0
    tp.add({"rank": 2, "group": 0, "sample_s": 1.0}, steps=300, dropped=False)
    for bad in ({"rank": 1, "group": 0}, {"rank": "1", "group": 0, "sample_s": 1.0},
                {"rank": 1, "group": 0, "sample_s": float("nan")}, {"rank": True, "group": 0, "sample_s": 1.0},
                {"rank": 1, "group": 0, "sample_s": -1.0}):
        tp.add(bad, steps=100, dropped=False)  # metadata that does not say is not counted
    ranks = tp.by_rank()
    assert (ranks[1].chunks, ranks[1].steps, ranks[1].dropped, ranks[1].sample_s) == (2, 200, 1, 4.0)
    assert ranks[1].speed == 50.0 and ranks[2].speed == 300.0
    assert set(tp.by_group()) == {(1, 0), (1, 1), (2, 0)}
    clock.t = 12.0  # rank 1's chunks leave the window
    assert set(tp.by_rank()) == {2}


def test_stragglers_are_the_ranks_below_a_kth_of_the_median():
    assert stragglers({1: 100.0, 2: 90.0, 3: 30.0}, k=2.0) == [3]
    assert stragglers({1: 100.0, 2: 60.0, 3: 55.0}, k=2.0) == []
    assert stragglers({1: 100.0}, k=2.0) == []
    assert stragglers({1: 100.0, 2: 10.0}, k=2.0) == [2]  # the median of two is their mean


def test_a_plan_travels_as_integers_and_bad_words_are_refused():
    plan = Rebalancing(shares={1: 0.25, 2: 0.75}, active={1: 0, 2: 3}, routes={1: 0, 2: 1})
    words = plan.encode(world_size=3)
    assert words[:3] == [NO_PLAN] * 3 and len(words) == 9
    back = Rebalancing.decode(words)
    assert back.shares == pytest.approx(plan.shares) and (back.active, back.routes) == (plan.active, plan.routes)
    assert Rebalancing.decode(Rebalancing().encode(3)) == Rebalancing()
    with pytest.raises(ValueError, match="share"):
        Rebalancing.decode([0, 1, NO_PLAN])
    with pytest.raises(ValueError, match="env groups"):
        Rebalancing.decode([500_000, -2, NO_PLAN])
    with pytest.raises(ValueError, match="send to rank 3 of 2"):
        Rebalancing.decode([NO_PLAN, NO_PLAN, 3, NO_PLAN, NO_PLAN, NO_PLAN])
    with pytest.raises(ValueError, match="3 words"):
        Rebalancing.decode([1, 2])


def test_the_rebalancer_shares_by_capacity_and_moves_one_group_per_window_within_bounds():
    clock = Clock()
    reb = Rebalancer({1: 0, 2: 0, 3: 0}, built=4, active=3, k=2.0, window_s=10.0, clock=clock)
    assert reb.plan.shares == pytest.approx({1: 1 / 3, 2: 1 / 3, 3: 1 / 3})
    plan = reb.update({1: 100.0, 2: 100.0}, version=1)  # rank 3 not measured yet: nothing changes
    assert plan.shares == pytest.approx({1: 1 / 3, 2: 1 / 3, 3: 1 / 3}) and not reb.moves
    speeds = {1: 100.0, 2: 120.0, 3: 20.0}
    plan = reb.update(speeds, version=2)
    assert plan.active == {1: 3, 2: 4, 3: 2}  # the straggler handed a group to the fastest rank
    assert reb.moves[-1].src == 3 and reb.moves[-1].dst == 2 and "rank 3" in reb.moves[-1].reason
    total = (100 + 120 + 20) * 3  # shares come from the capacity before the move, with headroom
    assert plan.shares == pytest.approx({r: HEADROOM * c / total for r, c in ((1, 300), (2, 360), (3, 60))})
    clock.t = 5.0
    reb.update(speeds, version=3)
    assert len(reb.moves) == 1  # one move per window
    clock.t = 20.0
    plan = reb.update(speeds, version=4)
    assert plan.active == {1: 4, 2: 4, 3: 1} and len(reb.moves) == 2  # rank 2 is full: rank 1 takes it
    clock.t = 40.0
    reb.update(speeds, version=5)
    assert len(reb.moves) == 2  # a straggler keeps its last group
    assert sum(reb.plan.shares.values()) == pytest.approx(HEADROOM)
    assert reb.plan.shares[3] < reb.plan.shares[1]


def test_shares_are_normalised_per_learner():
    reb = Rebalancer({2: 0, 3: 0, 4: 1, 5: 1}, built=1, active=1, k=4.0, window_s=1.0)
    plan = reb.update({2: 100.0, 3: 300.0, 4: 50.0, 5: 50.0}, version=1)
    assert plan.shares == pytest.approx({2: 0.25 * HEADROOM, 3: 0.75 * HEADROOM, 4: 0.5 * HEADROOM,
                                         5: 0.5 * HEADROOM})
    plan = reb.update({2: 1.0, 3: 300.0, 4: 50.0, 5: 50.0}, version=2)
    assert plan.shares[3] == 1.0  # at most all of its learner's chunks


def test_a_share_changes_admission_pace_without_moving_what_was_counted():
    adm = Admission(base=0, chunks_per_update=4, senders=2, max_staleness=1)
    for _ in range(4):
        adm.start()
    before = adm.needed()
    assert before == 2 - 1  # 4 batches at 2 per version
    adm.set_share(0.75, chunks_per_update=4)  # 3 per version from now on
    assert adm.needed() == before
    for _ in range(3):
        adm.start()
    assert adm.needed() == 3 - 1
    with pytest.raises(ValueError):
        adm.set_share(0.0, 4)


@pytest.mark.slow
def test_a_slow_rollout_rank_is_named_and_hands_an_env_group_to_a_fast_one(tmp_path):
    """Three processes under torchrun: rank 0 learns, ranks 1 and 2 roll out with a spare env
    group each, and rank 2 renders slowly. The learner names rank 2 a straggler, the plan
    (on the weights' control plane) moves one of its groups to rank 1 and gives rank 1 the
    larger share; every chunk is accounted for and the learner rejected none (GRPO groups
    whole)."""
    import json

    from dvla.metrics import read_metrics
    from tests.helpers.ranks import torchrun_job

    run = torchrun_job(tmp_path, "rebalance", [
        "swimlane.colocate=false", "swimlane.rebalance=true", "swimlane.spare_groups=1",
        "swimlane.env_groups=2", "swimlane.balance_window_s=2", "swimlane.max_staleness=4",
        "env.rank_options.2.render_cost_ms=25", "run.iterations=80"], nproc=3)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["version"] == 80
    assert summary["chunk_accounting"]["unaccounted"] == 0
    assert not any(v for k, v in summary["totals"].items() if k.startswith("rejected_")), summary["totals"]
    balance = summary["balance"]
    assert balance["moves"] and {(m["src"], m["dst"]) for m in balance["moves"]} == {(2, 1)}
    assert balance["plan"]["active"] == {"1": 3, "2": 1}
    assert balance["plan"]["shares"]["1"] > balance["plan"]["shares"]["2"]
    rows = read_metrics(run / "metrics.jsonl")
    assert any(r["stragglers"] >= 1 for r in rows) and rows[-1]["groups/rank1"] == 3.0
    from dvla.app.report.make import make_report
    report = make_report(run)
    assert "balance.png" in report["plots"] and "rebalancing: 1 env group move(s): " in report["summary"]
    fast, slow = (json.loads((run / f"summary_rank{r}.json").read_text()) for r in (1, 2))
    assert (fast["env_groups_active"], slow["env_groups_active"]) == (3, 1)  # the plan applied on each rank
    assert fast["chunks_by_group"][2] > 0  # the spare group sampled


def test_rank_options_and_the_rebalancing_settings_are_checked():
    from dvla.config import ConfigError, apply_overrides
    from dvla.envs import make_env
    from dvla.config.presets import debug

    cfg = apply_overrides(debug(), ["env.rank_options.2.render_wait_ms=5"]).validate()
    assert cfg.env.for_rank(2).options["render_wait_ms"] == 5 and "render_wait_ms" not in cfg.env.for_rank(1).options
    with pytest.raises(ConfigError, match="rank_options"):
        apply_overrides(debug(), ["env.rank_options.two.render_wait_ms=5"]).validate()
    with pytest.raises(ConfigError, match="render_wait_ms"):
        make_env(apply_overrides(debug(), ["env.options.render_wait_ms=-1"]).env)
    with pytest.raises(ConfigError, match="rebalance"):
        apply_overrides(debug(), ["swimlane.rebalance=true", "swimlane.mode=sync"]).validate()
    with pytest.raises(ConfigError, match="spare_groups"):
        apply_overrides(debug(), ["swimlane.spare_groups=1"]).validate()
    with pytest.raises(ConfigError, match="straggler_factor"):
        apply_overrides(debug(), ["swimlane.straggler_factor=1"]).validate()
    with pytest.raises(ConfigError, match="reissue"):
        apply_overrides(debug(), ["swimlane.reissue=true"]).validate()  # async by default


@pytest.mark.slow
def test_a_sync_round_does_not_wait_for_a_straggler_whose_work_is_reissued(tmp_path):
    """Sync mode, rank 2 rolling out slowly: rank 1 samples the round's work again while it
    waits, the learner's rounds take the first chunks of their version (every update
    on-policy), and what came too late is dropped and counted."""
    import json

    from dvla.metrics import read_metrics
    from tests.helpers.ranks import torchrun_job

    run = torchrun_job(tmp_path, "reissue", [
        "swimlane.mode=sync", "swimlane.reissue=true", "swimlane.colocate=false", "swimlane.env_groups=2",
        "env.rank_options.2.render_wait_ms=20", "run.iterations=20"], nproc=3)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["version"] == 20
    assert summary["chunk_accounting"]["unaccounted"] == 0
    assert not any(v for k, v in summary["totals"].items() if k.startswith("rejected_")), summary["totals"]
    assert summary["totals"]["dropped_stale"] > 0  # late chunks: counted, not learned from
    fast, slow = (json.loads((run / f"summary_rank{r}.json").read_text()) for r in (1, 2))
    assert fast["totals"]["chunks_reissued"] > 0
    assert fast["totals"]["chunks_sent"] > slow["totals"]["chunks_sent"]
    rows = read_metrics(run / "metrics.jsonl")
    assert all(r.get("staleness_max", 0) == 0 for r in rows)  # every round learned from its own version
