"""Ranks that switch between rollout and learning (``swimlane.roles=adaptive``): the
gradients are averaged over the learners that had samples, exactly, so a learner that sits
an update out (and applies the others' step) leaves the run where a fixed-role run puts it."""

from __future__ import annotations

import traceback
from functools import partial

import pytest
import torch
from tests.helpers.ranks import spawn_ranks
from tests.unit.swimlane.test_balance import Clock

from dvla.config import apply_overrides
from dvla.envs import make_env
from dvla.policy import PolicySpec, build_policy
from dvla.config.presets import debug
from dvla.rollout import collect_episodes

# What each of the two learners trains on in three updates: a batch index, or None (it sits
# the update out). In the fixed-role run both learners hold the same batch in update 2: the
# mean of two equal gradients is that gradient, which is what the adaptive run must average.
ADAPTIVE = {0: [0, 2, 3], 1: [1, None, 4]}
FIXED = {0: [0, 2, 3], 1: [1, 2, 4]}


def _state(algo) -> list[torch.Tensor]:
    """The weights and every Adam moment, in a fixed order."""
    moments = [t for p in algo.params for t in algo.optimizer.state[p].values() if t.dim() > 0]
    return [p.detach().clone() for p in algo.policy.parameters()] + [m.clone() for m in moments]


def _roles_worker(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from dvla.distributed import allreduce_mean_grads

    try:
        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
        cfg = debug()
        env = make_env(cfg.env, "cpu", seed=0)
        torch.manual_seed(0)
        policy = build_policy(cfg.policy.name, PolicySpec.for_env(env.spec, cfg.policy.action_chunk),
                              cfg.policy.options)
        batches = [collect_episodes(make_env(cfg.env, "cpu", seed=k), policy, 6, generator=torch.Generator()
                                    .manual_seed(k)) for k in range(5)]
        group = dist.new_group([0, 1])
        job = ["swimlane.topology=1x2", "swimlane.learner_ranks=2", "algo.name=ppo", "algo.lr=0.01",
               "algo.update_epochs=2", "algo.minibatches=4", "memory.enabled=false", "algo.shard=none"]

        def learner(*roles: str):
            """A learner as a rank of such a job builds it (the plan, then build_model): the
            product's own wiring of the gradient average."""
            from swimlane.assembly.build import Groups, build_model
            from swimlane.assembly.plan import plans_for

            job_cfg = apply_overrides(cfg, [*job, *roles])
            plan = plans_for(job_cfg, 2)[rank]
            return build_model(job_cfg, plan, torch.device("cpu"), Groups(learner=group), None).algo

        runs = {"adaptive": (ADAPTIVE, lambda: learner("swimlane.roles=adaptive")),
                "fixed": (FIXED, lambda: learner()),
                # sitting out as a zero gradient in a plain mean: wrong (the helper unmasked)
                "unmasked": (ADAPTIVE, lambda: unmasked(learner("swimlane.roles=adaptive")))}

        def unmasked(algo):
            algo.grad_sync = partial(allreduce_mean_grads, group=group, masked=False)
            return algo

        start = [p.detach().clone() for p in learner().policy.parameters()]
        got, samples = {}, {}
        for name, (plan, make) in runs.items():
            algo = make()
            samples[name] = []
            for update, which in enumerate(plan[rank]):
                if which is None:
                    algo.follow()
                    samples[name].append(0.0)
                else:
                    s = algo.update(batches[which], torch.Generator().manual_seed(update))
                    samples[name].append(s["samples"])
            got[name] = _state(algo)
        diff = {name: max(float((a - b).abs().max()) for a, b in zip(got[name], got["fixed"])) for name in got}
        moved = max(float((a - b).abs().max()) for a, b in zip(got["fixed"], start))
        digest = float(sum(t.double().sum() for t in got["adaptive"]))
        out.put((rank, {"diff": diff, "moved": moved, "samples": samples, "digest": digest}))
        dist.destroy_process_group()
    except BaseException as exc:
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}))


@pytest.mark.slow
def test_a_learner_that_sits_an_update_out_leaves_the_weights_of_a_fixed_role_run():
    """Two gloo learners, three PPO updates (two epochs of four minibatches each); in the
    second, learner 1 has no samples. With the masked average its weights and Adam moments
    end bit-identical to a fixed-role run's (there both learners hold learner 0's batch), on
    both ranks; a plain mean that counts the idle learner as a zero gradient does not."""
    res = spawn_ranks(_roles_worker, 2, timeout=180)
    for rank, r in res.items():
        assert r["moved"] > 1e-4, r  # the updates did something
        assert r["diff"]["adaptive"] == 0.0, (rank, r["diff"])
        assert r["diff"]["unmasked"] > 1e-5, (rank, r["diff"])  # the test can fail
        assert (r["samples"]["adaptive"][1] == 0.0) == (rank == 1), r["samples"]
    assert res[0]["digest"] == res[1]["digest"]  # one state on both learners


def test_routes_send_a_sampling_learner_to_itself_and_the_rest_to_the_least_loaded():
    from swimlane.adaptation.roles import routes_for

    assert routes_for([0], [0, 1, 2]) == {0: 0, 1: 0, 2: 0}
    assert routes_for([0, 1], [0, 2]) == {0: 0, 2: 1}  # rank 1 learns and samples nothing
    assert routes_for([0, 1], [0, 1, 2, 3]) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert routes_for([0, 3], [0, 1, 2]) == {0: 0, 1: 3, 2: 0}
    with pytest.raises(ValueError, match="at least as many"):
        routes_for([0, 1, 2], [0, 3])


def _planner(clock, candidates=(1,), rollout=(0, 1, 2)):
    from swimlane.adaptation.roles import RolePlanner

    return RolePlanner(list(candidates), list(rollout), low=0.1, high=0.5, window_s=10.0, clock=clock)


def _feed(planner, clock, wait: float, learn: float, steps: int, n: int, version: int, published=True,
          speed: float = 1000.0):
    """Up to ``n`` updates one second apart with this profile; True once one of them
    switched roles (the profile is the old setting's: the caller goes on with the new one's)."""
    for i in range(n):
        clock.t += 1.0
        planner.observe({0: (wait, learn), 1: (0.0, learn)}, steps, speed)
        if planner.update(version + i, published):
            return True
    return False


def test_the_planner_adds_a_learner_when_learning_is_the_bottleneck_and_goes_back_when_rollouts_are():
    clock = Clock()
    planner = _planner(clock)
    assert not _feed(planner, clock, wait=0.0, learn=1.0, steps=100, n=9, version=1)  # less than a window
    assert _feed(planner, clock, wait=0.0, learn=1.0, steps=100, n=1, version=10)
    assert planner.learners == [0, 1] and planner.routes == {0: 0, 2: 1}
    assert planner.switches[-1].to == "learner" and planner.switches[-1].version == 10
    # Between the thresholds nothing moves, however long it lasts.
    assert not _feed(planner, clock, wait=0.3, learn=0.7, steps=50, n=30, version=11)
    # The rollouts are the bottleneck, and 2 learners consume less than 1 did: back.
    assert _feed(planner, clock, wait=0.8, learn=0.2, steps=50, n=12, version=41)
    assert planner.learners == [0] and planner.switches[-1].to == "rollout"
    assert len(planner.switches) == 2
    # Learning is the bottleneck again, but 2 learners were measured worse than 1 is now:
    # no switch back within the memory; after it, the planner tries again.
    assert not _feed(planner, clock, wait=0.0, learn=1.0, steps=100, n=40, version=60)
    assert _feed(planner, clock, wait=0.0, learn=1.0, steps=100, n=80, version=100)
    assert len(planner.switches) == 3


def test_the_planner_forgets_what_it_measured_when_the_workload_changes_phase():
    clock = Clock()
    planner = _planner(clock)
    assert _feed(planner, clock, wait=0.0, learn=1.0, steps=100, n=12, version=1)  # joins
    assert _feed(planner, clock, wait=0.8, learn=0.2, steps=50, n=12, version=20)  # 2 learners worse: back
    assert not _feed(planner, clock, wait=0.0, learn=1.0, steps=100, n=20, version=40)  # remembered
    # A consumed rate that moves (episodes get shorter as the policy learns, and each update
    # takes as much less time) is no new phase.
    assert not _feed(planner, clock, wait=0.0, learn=0.6, steps=60, n=20, version=60)
    # The rollout ranks sample twice as fast (a new phase): the memory goes, and the planner
    # tries two learners again long before the memory would have expired.
    assert _feed(planner, clock, wait=0.0, learn=0.6, steps=60, n=12, version=80, speed=2000.0)
    assert planner.phase_shifts == 1 and planner.learners == [0, 1]


def test_the_planner_switches_at_most_once_per_window_only_at_published_versions_and_within_bounds():
    clock = Clock()
    planner = _planner(clock)
    assert not _feed(planner, clock, wait=0.0, learn=1.0, steps=100, n=20, version=1, published=False)
    assert _feed(planner, clock, wait=0.0, learn=1.0, steps=100, n=20, version=21)
    assert not _feed(planner, clock, wait=0.0, learn=1.0, steps=100, n=30, version=41)  # no candidate left
    assert len(planner.switches) == 1
    # One switch per window at most: with a window of 10 updates, 30 updates of a profile
    # that flips each time allow at most three.
    flip = _planner(clock)
    for v in range(30):
        slow_learning = v % 2 == 0
        _feed(flip, clock, wait=0.0 if slow_learning else 0.9, learn=1.0, steps=100 + v, n=1, version=v)
    assert len(flip.switches) <= 3
    assert all(b.version - a.version >= 10 for a, b in zip(flip.switches, flip.switches[1:]))
    lone = _planner(clock, rollout=(0, 1))  # rank 1 is the only other sampler: it must keep sampling
    assert not _feed(lone, clock, wait=0.0, learn=1.0, steps=100, n=30, version=1)
    assert lone.learners == [0]


def test_a_routed_sink_sends_each_chunk_to_the_planned_learner_and_tells_each_its_count():
    from swimlane.lanes.chunks import RoutedSink

    class Sink:
        def __init__(self):
            self.got, self.ended, self.closed = [], None, False

        def put(self, chunk, stop=None):
            self.got.append(chunk)
            return True

        def end(self, meta):
            self.ended = meta

        def close(self):
            self.closed = True

    sinks = {0: Sink(), 1: Sink()}
    routed = RoutedSink(sinks, learner=0)
    routed.put("a")
    routed.set_route(1)
    routed.put("b")
    routed.put("c")
    with pytest.raises(ValueError, match="no sender to rank 2"):
        routed.set_route(2)
    routed.end({"rank": 2, "chunks": 3})
    routed.close()
    assert sinks[0].got == ["a"] and sinks[1].got == ["b", "c"]
    assert sinks[0].ended == {"rank": 2, "chunks": 1} and sinks[1].ended == {"rank": 2, "chunks": 2}
    assert sinks[0].closed and sinks[1].closed


def test_adaptive_roles_are_checked():
    from dvla.config import ConfigError, apply_overrides

    base = ["swimlane.roles=adaptive", "swimlane.learner_ranks=2"]
    assert not apply_overrides(debug(), base).validate().sharded_learners  # auto: unsharded
    for bad, match in ((["swimlane.mode=sync"], "roles"), (["swimlane.colocate=false"], "roles"),
                       (["swimlane.learner_ranks=1"], "roles"), (["algo.shard=fsdp"], "algo.shard"),
                       (["swimlane.role_low=0.6"], "role_low")):
        with pytest.raises(ConfigError, match=match):
            apply_overrides(debug(), base + bad).validate()


def test_admission_counts_from_the_newest_weights_after_a_route_change():
    from swimlane.lanes.admission import Admission

    adm = Admission(base=0, chunks_per_update=1, senders=10, max_staleness=2)  # a one-in-ten share
    adm.start()
    assert adm.needed() == 8  # its next batch belongs ten versions on
    adm.anchor(5)  # now alone in feeding another learner, at version 5
    adm.set_share(1.0, chunks_per_update=1)
    assert adm.admits(5) and adm.needed() == 3
    adm.start()
    assert adm.needed() == 4
