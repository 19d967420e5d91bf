"""The swimlane: the serial and threaded drivers' sync-mode equivalence, staleness bound,
error propagation, stop, double-buffered weights, tracing, and a 3-process run over the
real planes that learns."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from dvla.config import ConfigError, apply_overrides
from dvla.metrics import read_metrics
from dvla.config.presets import debug, fast_reach
from dvla.rollout import collect_episodes
from swimlane import LaneError, Swimlane, draw_gantt, load_trace, utilization
from swimlane.lanes.channels import Chunk
from swimlane.lanes.chunks import concat
from swimlane.lanes.weights import DoubleBufferedWeights


def cfg_for(tmp_path, *overrides, name="run"):
    return apply_overrides(debug(), [f"run.out_dir={tmp_path / name}", *overrides])


# (return_mean, loss) per update on this config, measured with the synchronous trainer at
# a8d96ab, the commit before the lanes became classes (the serial driver replaced it): the
# reference must not drift either.
PINNED = {
    "grpo": [(0.0, 0.0), (0.375, 0.17508791014552116), (0.0, 0.0), (0.0, 0.0)],
    "ppo": [(0.375, 0.027905676513910294), (0.0, 2.1167099475860596e-05), (0.125, 0.005153369158506393),
            (0.0, -6.70403242111206e-05)],
}


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_serial_driver_equals_threaded_sync_mode_and_the_synchronous_trainer(tmp_path, algo):
    """Same seed, max staleness 0, sync mode: the serial driver (every lane in one thread)
    and the threaded driver learn bit-identically (weights and metrics), and both give the
    numbers the synchronous trainer gave before the lanes were restructured."""
    ov = ["swimlane.mode=sync", "swimlane.env_groups=1", "swimlane.max_staleness=0", "run.iterations=4",
          f"algo.name={algo}"]
    if algo == "ppo":
        ov.append("policy.options.value_head=true")
    runs = {}
    for driver in ("serial", "threads"):
        lanes = Swimlane(cfg_for(tmp_path, *ov, f"swimlane.driver={driver}", name=driver))
        summary = lanes.run()
        assert summary["version"] == 4 and summary["dropped_stale"] == 0
        runs[driver] = lanes
    ref, a = runs["serial"], read_metrics(tmp_path / "serial" / "metrics.jsonl")
    for got, want in zip([(r["return_mean"], r["loss"]) for r in a], PINNED[algo], strict=True):
        # abs: float32 rounding of a loss near zero (2e-5, a sum of terms of about 1e-2) differs
        # between CPUs by about 1e-8; the drivers below must still agree bit for bit.
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    for driver, lanes in runs.items():
        b = read_metrics(tmp_path / driver / "metrics.jsonl")
        for ra, rb in zip(a, b, strict=True):
            for key in ("version", "success_rate", "return_mean", "loss", "approx_kl", "env_steps"):
                assert ra[key] == rb[key], (driver, key, ra, rb)
        for (k, p), q in zip(ref.policy.state_dict().items(), lanes.policy.state_dict().values()):
            assert torch.equal(p, q), (driver, k)


def test_the_serial_driver_is_for_sync_mode_in_one_process(tmp_path):
    with pytest.raises(ConfigError, match="swimlane.driver: serial needs swimlane.mode=sync"):
        cfg_for(tmp_path, "swimlane.driver=serial").validate()
    with pytest.raises(ConfigError, match=r"swimlane.driver: serial needs swimlane.env_groups \(5\) <= "):
        cfg_for(tmp_path, "swimlane.driver=serial", "swimlane.mode=sync", "swimlane.env_groups=5").validate()
    with pytest.raises(ConfigError, match="swimlane.driver: serial runs one process, the world has 2"):
        Swimlane(cfg_for(tmp_path, "swimlane.driver=serial", "swimlane.mode=sync"), rank=0, world_size=2)


def test_a_lane_error_under_the_serial_driver_names_the_lane(tmp_path):
    lanes = Swimlane(cfg_for(tmp_path, "swimlane.driver=serial", "swimlane.mode=sync", "run.iterations=3"))
    real_step, calls = lanes.envs[0].step, {"n": 0}

    def broken_step(actions):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise RuntimeError("simulator exploded")
        return real_step(actions)

    lanes.envs[0].step = broken_step
    with pytest.raises(LaneError, match="lane 'sampling' failed.*env group 0 failed 3 times in a row"):
        lanes.run()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["error"].startswith("swimlane lane 'sampling'")


def test_async_run_overlaps_lanes_and_writes_outputs(tmp_path):
    cfg = cfg_for(tmp_path, "run.iterations=6", "swimlane.env_groups=2")
    summary = Swimlane(cfg).run()
    out = tmp_path / "run"
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness_max"] <= cfg.swimlane.max_staleness for r in rows)
    assert summary["publishes"] >= 2 and summary["chunks_consumed"] == 6
    acc = summary["chunk_accounting"]  # every chunk sampled is accounted for
    assert acc["unaccounted"] == 0 and acc["consumed"] == 6 and acc["sent"] == summary["chunks_sent"]
    assert (out / "weights.safetensors").exists() and (out / "summary.json").exists()
    meta, spans = load_trace(out / "trace.json")
    assert meta["mode"] == "async"
    assert {s[0] for s in spans} == {"sampling", "inference", "gradient", "broadcast"}
    util = utilization(spans)
    assert all(0 < u["utilization"] <= 1 for u in util.values())
    # Once the last update has its chunks the rollout lanes stop: at most the step each
    # group had its actions for (without the stop they sample on through the update).
    last_learn = max(b for lane, kind, b, e in spans if lane == "gradient" and kind == "learn")
    late = [b for lane, kind, b, e in spans if lane == "sampling" and kind == "sim" and b > last_learn]
    assert len(late) <= cfg.swimlane.env_groups
    png = draw_gantt(spans, tmp_path / "gantt.png")
    assert png.stat().st_size > 10_000


def test_run_memory_lives_in_the_two_pools(tmp_path):
    """Weights, optimizer state and weight buffers come from the persistent pool (sealed
    after start-up); rollout buffers and observation batches are reused from the transient
    pool, so a long run stops creating blocks after its first updates."""
    cfg = cfg_for(tmp_path, "run.iterations=12", "swimlane.env_groups=2")
    lanes = Swimlane(cfg)
    assert lanes.memory.persistent.sealed
    tags = set(lanes.memory.persistent.tensors())
    for prefix in ("policy/", "optimizer/exp_avg", "optimizer/exp_avg_sq", "snapshot/", "replica0/", "replica1/"):
        assert any(t.startswith(prefix) for t in tags), (prefix, tags)
    # The learner's parameters and Adam state are views into persistent memory.
    p = next(lanes.policy.parameters())
    assert lanes.algo.optimizer.state[p]["exp_avg"].shape == p.shape
    summary = lanes.run()
    mem = summary["memory"]
    tr = mem["transient"]
    assert tr["reuses"] > 3 * tr["allocations"] > 0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    created = [r["mem/transient/allocations"] for r in rows]
    assert created[-1] == created[len(created) // 2]  # steady state: no new blocks
    assert all(r["mem/persistent/reserved_mb"] == rows[0]["mem/persistent/reserved_mb"] for r in rows)
    # Chunks handed back after each update: only what is in flight stays in use.
    assert tr["in_use_bytes"] <= tr["peak_in_use_bytes"] and tr["peak_in_use_bytes"] < tr["reserved_bytes"] * 1.01


def test_memory_budgets_stop_the_run_with_a_clear_error(tmp_path):
    from memory import PoolBudgetError

    with pytest.raises(PoolBudgetError, match="persistent pool.*budget of 64.0 KiB"):
        Swimlane(cfg_for(tmp_path, "memory.persistent_budget=64KiB"))
    lanes = Swimlane(cfg_for(tmp_path, "memory.transient_budget=8KiB", name="t"))
    with pytest.raises(LaneError, match="sampling.*transient pool: a request of .* budget of 8.0 KiB"):
        lanes.run()
    with pytest.raises(ConfigError, match="memory.transient_budget"):
        cfg_for(tmp_path, "memory.transient_budget=lots").validate()
    # Unmanaged memory (plain allocation) trains the same way.
    summary = Swimlane(cfg_for(tmp_path, "memory.enabled=false", name="plain")).run()
    assert "memory" not in summary and summary["version"] == 3


def _chunk(policy, env, version, offset):
    return collect_episodes(env, policy, 8, group_size=4, policy_version=version, group_offset=offset)


def test_stale_chunks_are_dropped_and_counted(tmp_path):
    """Feed the gradient lane by hand, in this thread: chunks older than max_staleness are
    dropped and counted, and only usable ones count as progress."""
    from swimlane.lanes.chunks import LocalChunks
    from swimlane.observation.health import StallTimer
    from swimlane.lanes import GradientConfig, GradientLane
    from swimlane.observation.ledger import Ledger

    lanes = Swimlane(cfg_for(tmp_path, "run.iterations=3", "swimlane.max_staleness=0"))
    env, stop, source, ledger = lanes.envs[0], threading.Event(), LocalChunks(8), Ledger()
    # learner at 0: v0 ok -> 1; v0 stale; v1 ok -> 2; v0 stale; v2 ok -> 3
    for i, v in enumerate([0, 0, 1, 0, 2]):
        assert source.put(Chunk(_chunk(lanes.policy, env, v, i * 2), {}, None), stop)
    version, seen = [0], []

    def finish(update):
        version[0] += 1
        seen.append(update.batch.policy_version.max().item())
        return version[0] == 3

    lane = GradientLane(source=source, algo=lanes.algo, generator=torch.Generator().manual_seed(0), ledger=ledger,
                       tracer=lanes.state.tracer, cfg=GradientConfig(need=1, max_staleness=0, iterations=3,
                                                              stop_rollouts_before_last=False),
                       version=lambda: version[0], finish_update=finish, check_health=lambda stall: None,
                       stall=StallTimer(0.0))
    lane.run(stop)
    assert version[0] == 3 and seen == [0, 1, 2] and source.depth() == 0
    assert ledger["dropped_stale"] == 2 and ledger["chunks_consumed"] == 3


def test_off_policy_update_recomputes_proximal_log_probs(tmp_path):
    """A batch two versions old: every step's proximal log-prob is recomputed with the
    learner's weights (moved away from the sampling ones), so it differs from the
    behaviour log-prob and equals what those weights give the action."""
    lanes = Swimlane(cfg_for(tmp_path))
    algo = lanes.algo
    batch = _chunk(lanes.policy, lanes.envs[0], 0, 0)
    on = algo.update(batch, torch.Generator().manual_seed(0), learner_version=0)
    assert on["staleness_max"] == 0 and "is_weight_mean" not in on
    with torch.no_grad():  # the learner's weights have moved on since the batch was sampled
        for p in lanes.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    data = algo._flatten(batch, *algo.advantages(batch))
    expected = algo.proximal_log_probs(data, chunk=data["actions"].shape[0])  # the current weights
    assert not torch.allclose(expected, data["behav_logp"], atol=1e-3)
    calls, minibatches, real_step = [], [], algo._step
    real_prox = algo.proximal_log_probs

    def prox_spy(d, chunk, *padding):
        calls.append(d["actions"].shape[0])
        return real_prox(d, chunk, *padding)

    def step_spy(mb):
        if not minibatches:  # the first step of the update, before any weight changes
            now = real_prox(mb, mb["actions"].shape[0])  # these steps under the learner's weights
            algo.policy.train()
            minibatches.append({"now": now, **{k: mb[k].clone() for k in ("behav_logp", "prox_logp")}})
        return real_step(mb)

    algo.proximal_log_probs, algo._step = prox_spy, step_spy
    off = algo.update(batch, torch.Generator().manual_seed(0), learner_version=2)
    assert calls == [data["actions"].shape[0]]  # one recompute over every (stale) step
    assert off["staleness_mean"] == 2
    mb = minibatches[0]
    torch.testing.assert_close(mb["prox_logp"], mb["now"], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(mb["prox_logp"], mb["behav_logp"], atol=1e-3)
    # The importance weights pi_prox / pi_behav are not all 1: the correction is at work.
    assert off["is_weight_mean"] > 0 and abs(off["is_weight_mean"] - 1.0) > 1e-4


def test_a_mixed_batch_recomputes_proximal_log_probs_of_its_stale_steps_only(tmp_path):
    """Steps sampled by the learner's current weights keep their behaviour log-probs as
    the proximal ones; only the stale steps go through the proximal forward pass."""
    lanes = Swimlane(cfg_for(tmp_path))
    env, algo = lanes.envs[0], lanes.algo
    batch = concat([_chunk(lanes.policy, env, 2, 0), _chunk(lanes.policy, env, 0, 2)])
    with torch.no_grad():  # make the learner's weights differ from the ones that sampled
        for p in lanes.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    version = batch.policy_version[batch.valid]
    seen, real_prox, real_step = [], algo.proximal_log_probs, algo._step

    def prox_spy(data, *a, **kw):
        seen.append(data["actions"].shape[0])
        return real_prox(data, *a, **kw)

    minibatches = []

    def step_spy(mb):
        minibatches.append({k: mb[k].clone() for k in ("behav_logp", "prox_logp")})
        return real_step(mb)

    algo.proximal_log_probs, algo._step = prox_spy, step_spy
    stats = algo.update(batch, torch.Generator().manual_seed(0), learner_version=2)
    n_stale = int((version == 0).sum())
    assert 0 < n_stale < version.numel() and seen == [n_stale]
    assert stats["staleness_max"] == 2
    fresh = stale = 0
    for mb in minibatches:  # a fresh step's proximal log-prob is exactly its behaviour one
        same = mb["prox_logp"] == mb["behav_logp"]
        fresh += int(same.sum())
        stale += int((~same).sum())
    epochs = lanes.cfg.algo.update_epochs
    assert fresh == epochs * (version.numel() - n_stale) and stale == epochs * n_stale


def test_proximal_loglinear_interpolates_by_version_lag_without_a_forward_pass(tmp_path, monkeypatch):
    """algo.proximal=loglinear: no proximal forward pass; in each minibatch a stale step's
    proximal log-prob is behav + lag / (lag + 1) * (log pi_theta - behav), a fresh step's is
    its behaviour log-prob, and the loss gets both with the truncated importance weight."""
    import dvla.algos.base as base

    lanes = Swimlane(cfg_for(tmp_path, "algo.proximal=loglinear"))
    env, algo = lanes.envs[0], lanes.algo
    batch = concat([_chunk(lanes.policy, env, 2, 0), _chunk(lanes.policy, env, 0, 2)])
    with torch.no_grad():  # make the trained policy differ from the one that sampled
        for p in lanes.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    version = batch.policy_version[batch.valid]
    monkeypatch.setattr(algo, "proximal_log_probs", lambda *a, **k: pytest.fail("proximal forward pass"))
    calls, real_loss = [], base.clipped_policy_loss

    def loss_spy(new, prox, adv, clip, behav_log_probs=None, max_is_weight=None, mask=None, total=None):
        calls.append((new.detach().clone(), prox.clone(), behav_log_probs.clone(), max_is_weight))
        return real_loss(new, prox, adv, clip, behav_log_probs=behav_log_probs, max_is_weight=max_is_weight,
                         mask=mask, total=total)

    monkeypatch.setattr(base, "clipped_policy_loss", loss_spy)
    stats = algo.update(batch, torch.Generator().manual_seed(0), learner_version=2)
    cfg = lanes.cfg.algo
    assert len(calls) == cfg.update_epochs * cfg.minibatches
    fresh = stale = 0
    for new, prox, behav, cap in calls:
        assert cap == cfg.max_is_weight
        alpha = (prox - behav) / (new - behav)  # 0 for fresh steps, 2 / 3 for the lag-2 ones
        moved = (new - behav).abs() > 1e-3  # where the ratio is well defined
        is_fresh = prox == behav
        fresh += int(is_fresh.sum())
        stale += int((~is_fresh).sum())
        assert torch.allclose(alpha[moved & ~is_fresh], torch.tensor(2 / 3), atol=1e-3)
    n_stale = int((version == 0).sum())
    assert 0 < n_stale < version.numel()
    assert stale == cfg.update_epochs * n_stale and fresh == cfg.update_epochs * (version.numel() - n_stale)
    assert stats["staleness_max"] == 2 and stats["is_weight_mean"] > 0 and 0 <= stats["is_weight_clipped"] <= 1


@pytest.mark.slow
def test_an_async_run_with_the_loglinear_proximal_learns(tmp_path):
    """The interpolated proximal policy is a working off-policy correction: an async run
    on stale data learns the fast env."""
    lanes = Swimlane(apply_overrides(fast_reach(), [
        "algo.proximal=loglinear", "run.iterations=30", "env.image_size=16", "env.n_envs=32",
        "swimlane.env_groups=2", "swimlane.chunks_per_update=2", "run.torch_threads=1", "run.progress=false",
        f"run.out_dir={tmp_path / 'run'}"]))
    summary = lanes.run()
    assert summary["version"] == 30
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert sum(r["staleness_mean"] for r in rows) / len(rows) > 0.5  # the correction was at work
    success = [r["success_rate"] for r in rows]
    first, last = sum(success[:6]) / 6, sum(success[-6:]) / 6
    assert last > first + 0.25, (first, last)


def test_an_exception_in_a_lane_ends_the_run_with_its_traceback(tmp_path):
    lanes = Swimlane(cfg_for(tmp_path, "run.iterations=1000"))
    calls = {"n": 0}
    real_step = lanes.envs[1].step

    def broken_step(actions):
        calls["n"] += 1
        if calls["n"] >= 3:  # fails for good: after max_env_failures resets the run stops
            raise RuntimeError("simulator exploded")
        return real_step(actions)

    lanes.envs[1].step = broken_step
    t0 = time.monotonic()
    with pytest.raises(LaneError, match="sampling.*simulator exploded") as info:
        lanes.run()
    assert time.monotonic() - t0 < 30
    assert "broken_step" in str(info.value)  # the lane's traceback is in the message
    assert "env group 1 failed 3 times in a row" in str(info.value)


def test_a_simulator_exception_resets_its_group_and_is_counted(tmp_path, monkeypatch):
    import swimlane.assembly.wiring as wiring

    # A dropped batch leaves the rollouts throttled until the learner publishes, which it
    # cannot without that batch: they sample anyway after THROTTLE_S (2 s), 8 s of this
    # test's 9 with two errors. A shorter wait proves the same.
    monkeypatch.setattr(wiring, "THROTTLE_S", 0.2)
    lanes = Swimlane(cfg_for(tmp_path, "run.iterations=6", "swimlane.env_groups=2"))
    real_step, calls = lanes.envs[1].step, {"n": 0}

    def flaky_step(actions):
        calls["n"] += 1
        if calls["n"] in (3, 9):
            raise RuntimeError("contact solver diverged")
        return real_step(actions)

    lanes.envs[1].step = flaky_step
    summary = lanes.run()
    assert summary["version"] == 6 and summary["env_errors"] == 2
    _, spans = load_trace(tmp_path / "run" / "trace.json")
    assert sum(1 for s in spans if s[:2] == ("sampling", "env_error")) == 2


def test_a_stuck_simulator_is_reported_not_a_silent_hang(tmp_path, monkeypatch):
    import swimlane.assembly.lifecycle as runner

    # run() leaves the stuck lane after its grace periods (10 s and 5 s, which
    # test_a_stop_does_not_wait_forever_for_a_lane_blocked_in_a_collective tests): shortened
    # here, where only the report is tested.
    monkeypatch.setattr(runner, "_STOP_GRACE_S", 0.5)
    monkeypatch.setattr(runner, "_JOIN_S", 0.5)
    lanes = Swimlane(cfg_for(tmp_path, "run.iterations=1000", "swimlane.stall_timeout_s=2"))
    release = threading.Event()
    real_step = lanes.envs[0].step
    calls = {"n": 0}

    def stuck_step(actions):  # the third step never returns (until the test lets it go)
        calls["n"] += 1
        if calls["n"] >= 3:
            release.wait(60)
        return real_step(actions)

    for env in lanes.envs:
        env.step = stuck_step
    t0 = time.monotonic()
    try:
        with pytest.raises(LaneError, match=r"gradient.*no usable trajectory chunk for 2s \(swimlane.stall_timeout_s\)"):
            lanes.run()
    finally:
        release.set()
    assert time.monotonic() - t0 < 20


def test_gradient_lane_error_is_reported(tmp_path):
    lanes = Swimlane(cfg_for(tmp_path, "run.iterations=1000"))

    def bad_update(*a, **k):
        raise ValueError("nan in loss")

    lanes.algo.update = bad_update
    with pytest.raises(LaneError, match="gradient.*nan in loss"):
        lanes.run()


def test_request_stop_ends_a_long_run(tmp_path):
    lanes = Swimlane(cfg_for(tmp_path, "run.iterations=100000"))
    threading.Timer(1.0, lanes.request_stop).start()
    t0 = time.monotonic()
    summary = lanes.run()
    assert time.monotonic() - t0 < 30
    assert 0 < summary["version"] < 100000


def test_a_stop_does_not_wait_forever_for_a_lane_blocked_in_a_collective(tmp_path, monkeypatch):
    """torchrun stops the group with SIGTERM when a peer dies and kills it 30 s later. A lane
    blocked in a collective with the dead peer never returns, so run() leaves it after a
    grace period and still writes the summary."""
    import swimlane.assembly.lifecycle as runner

    monkeypatch.setattr(runner, "_STOP_GRACE_S", 0.5)
    monkeypatch.setattr(runner, "_JOIN_S", 0.5)
    lanes = Swimlane(cfg_for(tmp_path, "run.iterations=100000"))
    never = threading.Event()
    real_write, writes = lanes.parts.weights.write, []

    def write_then_block(version, flats):  # the first publish works, the next one never returns
        if writes:
            never.wait()
        writes.append(version)
        real_write(version, flats)

    lanes.parts.weights.write = write_then_block  # as a broadcast whose peer died would block
    threading.Timer(2.0, lanes.request_stop).start()
    t0, result = time.monotonic(), {}
    run = threading.Thread(target=lambda: result.update(lanes.run()), daemon=True)
    run.start()
    run.join(timeout=30)  # fail, not hang, should run() wait for the blocked lane
    assert not run.is_alive(), "run() is still waiting for the blocked broadcast lane"
    assert time.monotonic() - t0 < 2.0 + 8.0  # the stop at 2 s, grace and joins 0.5 s each, slack
    summary = result
    assert summary["lanes_left_running"] == ["broadcast"] and summary["version"] >= 1
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["lanes_left_running"] == ["broadcast"]
    never.set()


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
def test_gradient_nice_lowers_the_priority_of_the_gradient_lane_only(tmp_path):
    lanes = Swimlane(cfg_for(tmp_path, "run.iterations=2", "swimlane.gradient_nice=3"))

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base, seen = nice(), {}
    real_update, real_step = lanes.algo.update, lanes.envs[0].step

    def update(*a, **k):
        seen["gradient"] = nice()
        return real_update(*a, **k)

    def step(*a, **k):
        seen["sampling"] = nice()
        return real_step(*a, **k)

    lanes.algo.update, lanes.envs[0].step = update, step
    assert lanes.run()["version"] == 2
    assert seen == {"gradient": min(base + 3, 19), "sampling": base} and nice() == base
    with pytest.raises(ConfigError, match=r"swimlane.gradient_nice: must be in \[0, 19\], got -1"):
        cfg_for(tmp_path, "swimlane.gradient_nice=-1").validate()


def test_bad_roles_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="swimlane.learner_ranks"):
        Swimlane(cfg_for(tmp_path, "swimlane.learner_ranks=2"))
    with pytest.raises(ConfigError, match="swimlane.colocate"):
        Swimlane(cfg_for(tmp_path, "swimlane.colocate=false"))
    with pytest.raises(ConfigError, match="swimlane.topology: '2x2' describes 4 ranks, the world has 1"):
        Swimlane(cfg_for(tmp_path, "swimlane.topology=2x2"))
    with pytest.raises(ConfigError, match="swimlane.topology: "):
        Swimlane(cfg_for(tmp_path, "swimlane.topology=two hosts"))
    with pytest.raises(ConfigError, match="swimlane.broadcast_every: must be 1 in sync mode"):
        cfg_for(tmp_path, "swimlane.mode=sync", "swimlane.broadcast_every=2").validate()
    with pytest.raises(ConfigError, match=r"swimlane.max_staleness: must be >= broadcast_every - 1 = 2 .*got 1"):
        cfg_for(tmp_path, "swimlane.broadcast_every=3", "swimlane.max_staleness=1").validate()


def test_publishing_every_third_version_does_not_livelock(tmp_path):
    """Rollouts see only every broadcast_every-th version; with max_staleness =
    broadcast_every - 1 (the least allowed) the learner still gets data it can use at
    every version in between (it used to stop at version 2 with max_staleness=1)."""
    lanes = Swimlane(cfg_for(tmp_path, "swimlane.broadcast_every=3", "swimlane.max_staleness=2",
                             "run.iterations=9", "swimlane.stall_timeout_s=60"))
    t0 = time.monotonic()
    summary = lanes.run()
    assert summary["version"] == 9 and time.monotonic() - t0 < 60
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert max(r["staleness_max"] for r in rows) == 2  # data from two versions behind was used


def test_a_learner_that_drops_every_chunk_reports_a_stall(tmp_path, monkeypatch):
    """Chunks that arrive but are all too stale are no progress: the stall check fires
    (it used to count a dropped chunk as activity and wait forever)."""
    import swimlane.assembly.wiring as wiring

    monkeypatch.setattr(wiring, "THROTTLE_S", 0.2)  # 2 s in a run; the stall below is 10 times it
    lanes = Swimlane(cfg_for(tmp_path, "run.iterations=1000", "swimlane.stall_timeout_s=2"))
    for lane in (lanes.lanes.sampling, lanes.lanes.gradient):  # every chunk is too stale (not a valid
        lane.cfg.max_staleness = -1  # config; the test forces it on the lanes)
    t0 = time.monotonic()
    # Admission holds the rollouts back for THROTTLE_S (no weights fresh enough), then they
    # sample anyway, and the learner drops what arrives.
    with pytest.raises(LaneError, match=r"no usable trajectory chunk for 2s .*dropped_stale=[1-9]"):
        lanes.run()
    assert time.monotonic() - t0 < 30


def test_double_buffered_weights_never_expose_a_torn_version():
    """A writer publishes versions (every weight = version) as fast as it can while a
    reader acquires and checks that the replica it got is entirely one version."""
    replicas = [torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)]
    flats = [[r.weight.data, r.bias.data] for r in replicas]
    w = DoubleBufferedWeights(replicas, flats)
    stop = threading.Event()

    def writer():
        v = 0
        while not stop.is_set():
            w.write(v, [torch.full((64, 64), float(v)), torch.full((64,), float(v))])
            v += 1

    t = threading.Thread(target=writer)
    t.start()
    seen = []
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            model, version = w.acquire()
            if version < 0:
                continue
            for _ in range(3):  # the writer is busy meanwhile; the active replica must not change
                assert bool((model.weight == version).all()) and bool((model.bias == version).all())
            seen.append(version)
    finally:
        stop.set()
        t.join()
    assert len(set(seen)) > 5 and seen == sorted(seen)
    assert w.swaps > 5


@pytest.mark.slow
def test_three_process_run_learns_over_real_planes(tmp_path):
    """torchrun: rank 0 learns and publishes, ranks 1 and 2 sample and infer; chunks over
    the ZeroMQ data plane, weights over the gloo control plane. The policy must learn. The
    rollout ranks take turns (the lanes in processes, Sample Factory style): their sampling
    lanes answer their own requests, never waiting on the inference thread."""
    out = tmp_path / "mp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           "-m", "dvla.launch", "--preset", "fast_reach", "run.iterations=40", "env.image_size=16",
           "env.n_envs=32", "swimlane.chunks_per_update=2", "swimlane.colocate=false", "run.progress=false",
           "run.torch_threads=1", "run.tensorboard=false", "swimlane.take_turns=true", f"run.out_dir={out.parent}", f"run.name={out.name}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[:8000]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["version"] == 40 and summary["chunks_consumed"] == 80
    acc = summary["chunk_accounting"]
    assert acc["unaccounted"] == 0 and acc["lost_dead_peer"] == 0 and acc["consumed"] == 80
    sent = sum(json.loads((out / f"summary_rank{r}.json").read_text())["chunks_sent"] for r in (1, 2))
    assert acc["sent"] == sent == acc["received"] and acc["in_flight_at_exit"] == 0
    rows = read_metrics(out / "metrics.jsonl")
    success = [r["success_rate"] for r in rows]
    first, last = sum(success[:8]) / 8, sum(success[-8:]) / 8
    assert last > first + 0.25, (first, last)
    assert all(r["staleness_max"] <= 1 for r in rows)
    assert rows[-1]["chunks_sent"] >= 80 and rows[-1]["chunks_lost_dead_peer"] == 0  # accounting per update
    for rank in (1, 2):  # both rollout ranks sent chunks and received weights
        _, spans = load_trace(out / f"trace_rank{rank}.json")
        kinds = {(s[0], s[1]) for s in spans}
        assert ("sampling", "send") in kinds and ("broadcast", "receive") in kinds
        assert ("gradient", "learn") not in kinds
        waits = sum(1 for s in spans if (s[0], s[1]) == ("sampling", "wait"))
        infers = sum(1 for s in spans if (s[0], s[1]) == ("inference", "infer"))
        assert infers > 100 and waits <= 2, (waits, infers)  # inline: only the wait for the first weights


@pytest.mark.slow
def test_two_learner_ranks_average_gradients_and_finish(tmp_path):
    """Learner ranks 0 and 1 (both also sampling) and a rollout-only rank 2: chunks are
    routed per learner, gradients all-reduced between the learners, and the run ends. Both
    learners issue their collectives in one order (swimlane/agreement/ordering.py): update v's
    all-reduces, then the broadcast of v when v is published, then update v + 1."""
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           "-m", "dvla.launch", "--preset", "debug", "run.iterations=8", "swimlane.learner_ranks=2",
           "swimlane.broadcast_every=3", "swimlane.max_staleness=2",
           "data_plane.curve=true",  # chunks encrypted with CurveZMQ
           "run.torch_threads=1", "run.tensorboard=false", f"run.out_dir={out.parent}", f"run.name={out.name}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[:8000]
    assert json.loads((out / "summary.json").read_text())["version"] == 8
    for name in ("trace.json", "trace_rank1.json"):
        _, spans = load_trace(out / name)
        assert sum(1 for s in spans if s[:2] == ("gradient", "learn")) == 8
    _, spans = load_trace(out / "trace_rank2.json")
    assert not any(s[0] == "gradient" for s in spans)
    # Averaged gradients keep the two learners' weights identical after every update.
    learners = [json.loads((out / name).read_text()) for name in ("summary.json", "summary_rank1.json")]
    assert [s["role"] for s in learners] == ["learner+rollout", "learner+rollout"]
    assert learners[0]["weights_digest"] == learners[1]["weights_digest"]
    expected = ["broadcast 0"]
    for v in range(1, 9):
        expected += [f"update {v}"] + ([f"broadcast {v}"] if v % 3 == 0 or v == 8 else [])
    assert learners[0]["collective_sequence"] == learners[1]["collective_sequence"] == expected
    assert "collective_sequence" not in json.loads((out / "summary_rank2.json").read_text())

