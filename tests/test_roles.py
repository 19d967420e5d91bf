"""Ranks that switch between rollout and learning (``swimlane.roles=adaptive``): the
gradients are averaged over the learners that had samples, exactly, so a learner that sits
an update out (and applies the others' step) leaves the run where a fixed-role run puts it."""

from __future__ import annotations

import copy
import traceback
from functools import partial

import torch
from ranks import spawn_ranks

from dvla.algos import build_algorithm
from dvla.config import AlgoConfig
from dvla.envs import make_env
from dvla.policy import PolicySpec, build_policy
from dvla.presets import debug
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
        acfg = AlgoConfig(name="ppo", lr=1e-2, update_epochs=2, minibatches=4)
        group = dist.new_group([0, 1])
        runs = {"adaptive": (ADAPTIVE, True), "fixed": (FIXED, False),
                "unmasked": (ADAPTIVE, False)}  # sitting out as a zero gradient in a plain mean: wrong
        got, samples = {}, {}
        for name, (plan, masked) in runs.items():
            algo = build_algorithm(acfg, copy.deepcopy(policy), partial(allreduce_mean_grads, group=group,
                                                                         masked=masked))
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
        moved = max(float((a - b.detach()).abs().max()) for a, b in zip(got["fixed"], policy.parameters()))
        digest = float(sum(t.double().sum() for t in got["adaptive"]))
        out.put((rank, {"diff": diff, "moved": moved, "samples": samples, "digest": digest}))
        dist.destroy_process_group()
    except BaseException as exc:
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}))


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
