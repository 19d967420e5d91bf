"""The resource manager's controller on synthetic stage profiles: it converges, holds still
once converged (no oscillation under noise), respects its bounds, follows the bottleneck
and explores again when the workload shifts."""

import random

import pytest

from swimlane.adaptation.autotune import Controller, Knob, Profile


def peaked(px, py):
    def f(v):
        return 1000.0 / (1 + 0.3 * abs(v["x"] - px) + 0.2 * abs(v["y"] - py))
    return f


def drive(ctl, f, windows, noise=0.0, rng=None):
    seen = []
    for _ in range(windows):
        sps = f(ctl.values) * (1 + (rng.uniform(-noise, noise) if noise else 0.0))
        seen.append(ctl.observe(Profile(steps_per_s=sps)))
        for k in ctl.knobs.values():
            assert k.low <= ctl.values[k.name] <= k.high
    return seen


def knobs():
    return [Knob("x", 1, 8), Knob("y", 0, 10, step=1)]


def test_it_climbs_to_the_best_point_and_then_holds_still():
    ctl = Controller(knobs(), {"x": 8, "y": 0})
    drive(ctl, peaked(3, 5), 80)
    assert ctl.converged and ctl.values == {"x": 3, "y": 5}
    assert all(not d for d in drive(ctl, peaked(3, 5), 30))  # no move once converged
    assert all(d.reason.startswith(("try", "revert")) for d in ctl.decisions)


def test_noise_below_the_tolerance_does_not_make_it_oscillate():
    rng = random.Random(0)
    ctl = Controller(knobs(), {"x": 1, "y": 9}, tolerance=0.04, shift=0.2)
    drive(ctl, peaked(6, 2), 120, noise=0.01, rng=rng)
    assert ctl.converged and abs(ctl.values["x"] - 6) <= 1 and abs(ctl.values["y"] - 2) <= 1
    later = drive(ctl, peaked(6, 2), 50, noise=0.01, rng=rng)
    assert sum(len(d) for d in later) == 0


def test_a_phase_shift_makes_it_explore_again():
    ctl = Controller(knobs(), {"x": 4, "y": 4})
    drive(ctl, peaked(2, 2), 60)
    assert ctl.values == {"x": 2, "y": 2}
    drive(ctl, peaked(7, 8), 120)  # the workload changed: throughput fell by far more than `shift`
    assert ctl.converged and ctl.values == {"x": 7, "y": 8}


def test_it_tries_first_what_the_bottleneck_points_at_and_stays_in_bounds():
    ctl = Controller([Knob("groups", 1, 2), Knob("nice", 0, 10, step=5)], {"groups": 2, "nice": 0},
                     prefer={"sampling": ("nice", 1)})
    first = ctl.observe(Profile(steps_per_s=100.0, busy={"sampling": 0.95, "gradient": 0.4}))
    assert [(d.knob, d.old, d.new) for d in first] == [("nice", 0, 5)]
    assert "sampling busiest (95%)" in first[0].reason
    flat = drive(ctl, lambda v: 100.0, 20)  # nothing helps: every move reverted, then still
    assert ctl.converged and ctl.values == {"groups": 2, "nice": 0}
    assert sum(len(d) for d in flat[-5:]) == 0
    with pytest.raises(ValueError, match="low <= high"):
        Knob("bad", 3, 1)
    with pytest.raises(ValueError, match="no knob"):
        Controller([], {})


def test_after_a_revert_it_measures_again_so_a_lucky_window_sets_no_bar():
    """A lucky first window (130 where the values give 100) must not make every later move
    look worse: after reverting, the restored values are measured again, and a move worth
    +10% over them is kept."""
    ctl = Controller([Knob("x", 0, 1), Knob("y", 0, 1)], {"x": 0, "y": 0})

    def f(v):
        return 100.0 + 10.0 * v["y"] - 5.0 * v["x"]

    assert [(d.knob, d.new) for d in ctl.observe(Profile(steps_per_s=130.0))] == [("x", 1)]
    assert [(d.knob, d.new) for d in ctl.observe(Profile(steps_per_s=f(ctl.values)))] == [("x", 0)]  # revert only
    assert [(d.knob, d.new) for d in ctl.observe(Profile(steps_per_s=f(ctl.values)))] == [("y", 1)]
    kept = ctl.observe(Profile(steps_per_s=f(ctl.values)))  # 110 against the 100 just measured
    assert ctl.values["y"] == 1 and all(d.knob != "y" for d in kept)


def test_a_knob_without_effect_at_the_current_values_is_not_tried():
    """``needs``: while the lanes take turns, a wait for more groups' requests changes
    nothing, so no window goes to it; once turns are off again it is tried."""
    ctl = Controller([Knob("take_turns", 0, 1), Knob("wait", 0, 4, step=2)], {"take_turns": 1, "wait": 0},
                     needs={"wait": lambda v: v["take_turns"] == 0})
    assert ctl.moves() == [("take_turns", -1)]

    def f(v):
        return 100.0 + 20.0 * (1 - v["take_turns"]) + 5.0 * v["wait"]

    tried = [d.knob for window in drive(ctl, f, 30) for d in window]
    assert tried[0] == "take_turns" and "wait" in tried
    assert ctl.converged and ctl.values == {"take_turns": 0, "wait": 4}
    held = Controller([Knob("take_turns", 0, 1), Knob("wait", 0, 4, step=2)], {"take_turns": 1, "wait": 0},
                      needs={"wait": lambda v: v["take_turns"] == 0})
    drive(held, lambda v: 100.0 - 30.0 * (1 - v["take_turns"]), 30)  # turns stay on: the wait is never tried
    assert held.converged and all(d.knob == "take_turns" for d in held.decisions)


def test_lanes_contending_for_the_process_make_it_try_taking_turns_first():
    """Lanes busy for a core or more in a process that ran on little more than one of its
    cores (threads taking turns on the GIL) point at taking turns; lanes that ran in
    parallel, or a process with one core, point at the bottleneck."""
    def ctl():
        return Controller([Knob("groups", 1, 2), Knob("take_turns", 0, 1), Knob("nice", 0, 10, step=5)],
                          {"groups": 2, "take_turns": 0, "nice": 0},
                          prefer={"sampling": ("nice", 1), "contention": ("take_turns", 1)})

    busy = {"sampling": 0.6, "inference": 0.3, "gradient": 0.5}
    gil = Profile(steps_per_s=100.0, busy=busy, cpu_share=1.02, cores=2)
    assert gil.contended
    first = ctl().observe(gil)
    assert [(d.knob, d.new) for d in first] == [("take_turns", 1)]
    assert "lanes busy 1.40 cores while the process ran 1.02 of 2" in first[0].reason
    parallel = Profile(steps_per_s=100.0, busy=busy, cpu_share=1.7, cores=2)
    assert not parallel.contended and not Profile(steps_per_s=100.0, busy=busy).contended
    assert not Profile(steps_per_s=100.0, busy=busy, cpu_share=0.98, cores=1).contended
    assert [(d.knob, d.new) for d in ctl().observe(parallel)] == [("nice", 5)]


@pytest.mark.slow
def test_an_autotuned_run_logs_its_decisions_in_the_metrics(tmp_path):
    """swimlane.autotune on a live async run: windows measured, knobs moved within their
    bounds, the values and the count of decisions in every metrics row."""
    from dvla.config import apply_overrides
    from dvla.metrics import read_metrics
    from dvla.config.presets import fast_reach
    from swimlane import Swimlane

    lanes = Swimlane(apply_overrides(fast_reach(), [
        "swimlane.autotune=true", "swimlane.autotune_window_s=0.2", "swimlane.env_groups=3",
        "swimlane.autotune_start_groups=1", "env.options.render_cost_ms=2", "run.iterations=40", "env.image_size=16", "env.n_envs=32",
        "run.torch_threads=1", "run.progress=false", f"run.out_dir={tmp_path / 'run'}"]))
    summary = lanes.run()
    decisions = lanes.lanes.tuner.controller.decisions
    assert decisions and all(d.knob in ("env_groups", "gradient_nice", "inference_wait_ms", "take_turns",
                                        "torch_threads", "split_cpus") for d in decisions)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    tuned = [r for r in rows if "autotune_env_groups" in r]
    assert tuned and all(1 <= r["autotune_env_groups"] <= 3 and 0 <= r["autotune_gradient_nice"] <= 15
                         and r["autotune_take_turns"] in (0.0, 1.0) for r in tuned)
    assert lanes.lanes.turns.on == bool(lanes.lanes.tuner.controller.values["take_turns"])  # the knob is the switch
    assert tuned[-1]["autotune_decisions"] >= 1
    # autotune_start_groups=1: one group steps until a decision raises the count (spares wait)
    assert all(r["autotune_env_groups"] == 1 for r in tuned if r["autotune_decisions"] == 0)
    raised = max(r["autotune_env_groups"] for r in tuned)
    stepped = {int(g.split("/")[1]) for g, v in summary["balance"]["by_group"].items() if v["chunks"]}
    assert 0 in stepped and max(stepped) < raised
    from dvla.app.report.make import make_report

    result = make_report(tmp_path / "run")
    assert "autotune.png" in result["plots"] and result["plots"]["autotune.png"]["path"].is_file()


def test_autotune_is_for_async_threads():
    from dvla.config import ConfigError, apply_overrides
    from dvla.config.presets import fast_reach

    with pytest.raises(ConfigError, match="autotune"):
        apply_overrides(fast_reach(), ["swimlane.autotune=true", "swimlane.mode=sync"]).validate()
    with pytest.raises(ConfigError, match="take_turns"):
        apply_overrides(fast_reach(), ["swimlane.take_turns=true", "swimlane.driver=serial",
                                       "swimlane.mode=sync"]).validate()
    with pytest.raises(ConfigError, match="autotune_start_groups.*needs swimlane.autotune"):
        apply_overrides(fast_reach(), ["swimlane.autotune_start_groups=1"]).validate()
    with pytest.raises(ConfigError, match=r"autotune_start_groups: must be in \[0, env_groups=2\]"):
        apply_overrides(fast_reach(), ["swimlane.autotune=true", "swimlane.autotune_start_groups=3"]).validate()


@pytest.mark.slow
def test_a_run_taking_turns_learns_and_accounts_for_every_chunk(tmp_path):
    """swimlane.take_turns as a static setting: an async job whose lanes take turns runs to
    its last update, every chunk sent is consumed or counted as dropped, and the success
    rate of the fast_reach task rises as in the other modes."""
    from dvla.config import apply_overrides
    from dvla.config.presets import fast_reach
    from swimlane import Swimlane

    lanes = Swimlane(apply_overrides(fast_reach(), [
        "swimlane.take_turns=true", "run.iterations=30", "env.image_size=16", "run.torch_threads=1",
        "run.progress=false", f"run.out_dir={tmp_path / 'run'}"]))
    s = lanes.run()
    assert s["version"] == 30 and s["error"] is None and lanes.lanes.turns.on
    assert s["chunks_sent"] == s["chunks_consumed"] + s["dropped_stale"] + s["discarded_after_run"]
    rates = [h["success_rate"] for h in lanes.history]
    assert sum(rates[-5:]) / 5 > sum(rates[:5]) / 5 + 0.1


def test_the_tuner_measures_whole_chunks_and_waits_for_one():
    """Env steps are counted a chunk at a time: the rate runs from the last chunk counted
    before a window to the last one in it, and a window without a chunk goes on."""
    from swimlane.adaptation.autotune import Setting, Tuner
    from swimlane.observation.ledger import Ledger
    from swimlane.observation.trace import Tracer

    ledger, value = Ledger(), {"k": 1}
    tuner = Tuner([Setting(Knob("k", 0, 2), lambda: value["k"], lambda v: value.update(k=v))], ledger=ledger,
                  tracer=Tracer(), window_s=0.0)
    t0 = tuner.last[0]
    assert tuner.profile() is None and tuner.tick() == []  # no chunk counted yet
    ledger.add("env_steps_live", 1000)
    ledger.changed["env_steps_live"] = t0 + 0.5
    assert tuner.profile().steps_per_s == pytest.approx(2000)
    ledger.add("env_steps_live", 1000)
    ledger.add("env_steps_idle", 1000)
    ledger.changed["env_steps_live"] = t0 + 1.5
    p = tuner.profile()
    assert p.steps_per_s == pytest.approx(2000) and p.idle_env_share == pytest.approx(0.5)  # idle steps count


def test_the_rate_counts_idle_env_steps_so_a_policy_that_succeeds_sooner_is_no_slowdown():
    """A learning policy ends more episodes early, whose envs then wait for their batch: the
    useful steps of a chunk fall while the pace of the rollout stays. The profile's rate is
    the pace (every env step), so the controller does not read learning as its moves
    failing; the idle share reports the rest."""
    from swimlane.adaptation.autotune import Setting, Tuner
    from swimlane.observation.ledger import Ledger
    from swimlane.observation.trace import Tracer

    ledger = Ledger()
    tuner = Tuner([Setting(Knob("x", 0, 1), lambda: 0, lambda v: None)], ledger=ledger, tracer=Tracer(),
                  window_s=0.0)
    t0, profiles = tuner.last[0], []
    for i, live in enumerate((900, 600, 300)):  # every chunk 1000 env steps in 0.5 s, fewer of them useful
        ledger.add("env_steps_idle", 1000 - live)
        ledger.add("env_steps_live", live)
        ledger.changed["env_steps_live"] = t0 + 0.5 * (i + 1)
        profiles.append(tuner.profile())
    assert [p.steps_per_s for p in profiles] == pytest.approx([2000, 2000, 2000])  # useful steps: 1800, 1200, 600
    assert [p.idle_env_share for p in profiles] == pytest.approx([0.1, 0.4, 0.7])


def test_cpu_knobs_pin_the_lanes_threads_and_set_torch_threads():
    """The CPU quota knobs on real threads: split_cpus puts the gradient lane's thread on one
    half of the rank's CPUs and the rollout lanes' threads on the other, and back;
    torch_threads sets torch's intra-op threads."""
    import os
    import threading
    from types import SimpleNamespace

    import torch

    from dvla.config import SwimlaneConfig
    from swimlane.adaptation.tuning import tuner_for
    from swimlane.lanes.turns import Turns
    from swimlane.observation.ledger import Ledger
    from swimlane.observation.trace import Tracer

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs thread affinity and two CPUs")
    tids, release, started = {}, threading.Event(), threading.Barrier(4)

    def lane(name):
        tids[name] = threading.get_native_id()
        started.wait()
        release.wait(30)

    threads = [threading.Thread(target=lane, args=(n,), daemon=True) for n in ("sampling", "inference", "gradient")]
    for t in threads:
        t.start()
    started.wait()
    cpus = sorted(os.sched_getaffinity(0))
    half, threads_before = len(cpus) // 2, torch.get_num_threads()
    try:
        tuner = tuner_for(SwimlaneConfig(autotune=True, env_groups=1), SimpleNamespace(active=1),
                          SimpleNamespace(wait_s=0.0), lambda: dict(tids), Ledger(), Tracer(), Turns())
        knobs = tuner.settings
        assert {"env_groups", "take_turns", "gradient_nice", "torch_threads", "split_cpus"} <= knobs.keys()
        values = {"env_groups": 1, "take_turns": 1}  # taking turns, the lanes never compete for CPUs
        assert not knobs["split_cpus"].needs(values) and not knobs["gradient_nice"].needs(values)
        assert knobs["split_cpus"].needs({**values, "take_turns": 0}) and knobs["torch_threads"].needs is None
        knobs["split_cpus"].set(1)
        assert sorted(os.sched_getaffinity(tids["gradient"])) == cpus[half:] and knobs["split_cpus"].get() == 1
        assert sorted(os.sched_getaffinity(tids["sampling"])) == cpus[:half]
        assert sorted(os.sched_getaffinity(tids["inference"])) == cpus[:half]
        knobs["split_cpus"].set(0)
        assert all(sorted(os.sched_getaffinity(t)) == cpus for t in tids.values())
        knobs["torch_threads"].set(2)
        assert torch.get_num_threads() == 2 == knobs["torch_threads"].get()
    finally:
        torch.set_num_threads(threads_before)
        release.set()
        for t in threads:
            t.join(5)
