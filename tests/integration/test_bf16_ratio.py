"""bf16 inference replicas against an fp32 learner (``swimlane.publish_dtype=bf16``): at
identical weights the replica's behaviour log-probs are not the learner's, so a ratio taken
against them is not 1 and clips for nothing. Told the replicas' dtype, the learner recomputes
every step's proximal log-prob: the clipped ratio is exactly 1 at unchanged weights and the
precision gap goes into the truncated importance weight."""

from __future__ import annotations

import copy

import pytest
import torch

from dvla.algos import base as algo_base
from dvla.algos import build_algorithm
from dvla.config import AlgoConfig, apply_overrides
from dvla.envs import make_env
from dvla.policy import PolicySpec, build_policy
from dvla.config.presets import debug
from dvla.rollout import collect_episodes

CLIP = 0.002  # tighter than PPO's 0.2, so that the tiny model's bf16 gap shows as clipping


def _policy_and_bf16_batch(sharpen: float = 50.0):
    """An fp32 policy (its action head sharpened: a confident policy, as a trained one is, whose
    large logits bf16 rounds most) and a batch sampled by its bf16 copy, as an inference
    replica published in bf16 samples (under bf16 autocast, ``VLAPolicy._autocast``)."""
    cfg = apply_overrides(debug(), ["policy.action_chunk=4", "policy.options.n_bins=256"])
    env = make_env(cfg.env, "cpu", seed=0)
    torch.manual_seed(0)
    policy = build_policy("tiny_vla", PolicySpec.for_env(env.spec, 4), cfg.policy.options)
    with torch.no_grad():
        policy.action_head.weight.mul_(sharpen)
    replica = copy.deepcopy(policy).requires_grad_(False).to(torch.bfloat16)
    batch = collect_episodes(env, replica, 6, group_size=4, generator=torch.Generator().manual_seed(0))
    return policy, batch


class _Spy:
    """Records the clipped ratio's log (new - proximal) and the stats of every minibatch."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[torch.Tensor, torch.Tensor | None, dict]] = []
        real = algo_base.clipped_policy_loss

        def spy(new, prox, adv, clip_eps, **kw):
            loss, stats = real(new, prox, adv, clip_eps, **kw)
            self.calls.append(((new - prox).detach(), kw.get("mask"), {k: float(v) for k, v in stats.items()}))
            return loss, stats

        monkeypatch.setattr(algo_base, "clipped_policy_loss", spy)


def _first_minibatch(monkeypatch, policy, batch, behaviour_dtype, **algo):
    spy = _Spy(monkeypatch)
    cfg = AlgoConfig(**{"group_size": 4, "update_epochs": 1, "minibatches": 2, "lr": 1e-3, "clip_eps": CLIP,
                        **algo})
    learner = build_algorithm(cfg, copy.deepcopy(policy), behaviour_dtype=behaviour_dtype)
    learner.update(batch, torch.Generator().manual_seed(1), learner_version=0)  # every step fresh
    log_ratio, mask, stats = spy.calls[0]
    counted = log_ratio if mask is None else log_ratio[mask.bool()]
    return counted, stats


@pytest.mark.parametrize("ratio", ["joint", "dim"])
def test_a_bf16_behaviour_gives_ratio_one_against_an_fp32_learner(monkeypatch, ratio):
    policy, batch = _policy_and_bf16_batch()
    counted, stats = _first_minibatch(monkeypatch, policy, batch, torch.bfloat16, ratio=ratio)
    assert counted.numel() > 0
    assert torch.equal(counted, torch.zeros_like(counted)), float(counted.abs().max())  # exactly 1
    assert stats["clip_frac"] == 0.0 and stats["approx_kl"] == 0.0, stats
    # The gap is now the importance weight pi_prox / pi_behav (truncated at max_is_weight).
    assert "is_weight_mean" in stats and stats["is_weight_mean"] != 1.0, stats


def test_told_nothing_the_bf16_gap_is_in_the_ratio_and_clips(monkeypatch):
    """What the learner did before it was told the replicas' dtype (and still does with
    ``behaviour_dtype=None``): the behaviour log-probs are taken as the proximal ones."""
    policy, batch = _policy_and_bf16_batch()
    counted, stats = _first_minibatch(monkeypatch, policy, batch, None, ratio="joint")
    assert float(counted.abs().max()) > 1e-3, float(counted.abs().max())  # e^gap, not 1
    assert stats["clip_frac"] > 0.0 and "is_weight_mean" not in stats, stats


def test_a_bf16_learner_against_fp32_replicas_gets_ratio_one_too(monkeypatch):
    """``algo.precision=bf16`` (autocast, fp32 master weights) against fp32 replicas: the
    proximal pass runs under the training passes' autocast, so the ratio is exactly 1."""
    cfg = apply_overrides(debug(), ["policy.action_chunk=4", "policy.options.n_bins=256"])
    env = make_env(cfg.env, "cpu", seed=0)
    torch.manual_seed(0)
    policy = build_policy("tiny_vla", PolicySpec.for_env(env.spec, 4), cfg.policy.options)
    with torch.no_grad():
        policy.action_head.weight.mul_(50.0)
    batch = collect_episodes(env, policy, 6, group_size=4, generator=torch.Generator().manual_seed(0))
    counted, stats = _first_minibatch(monkeypatch, policy, batch, torch.float32, ratio="dim", precision="bf16")
    assert torch.equal(counted, torch.zeros_like(counted)), float(counted.abs().max())
    assert stats["clip_frac"] == 0.0, stats


def test_loglinear_recomputes_too_when_the_numerics_differ(monkeypatch):
    """``algo.proximal=loglinear`` interpolates from the behaviour log-probs, which would keep
    the bf16 gap in the ratio: with bf16 replicas every step is recomputed instead."""
    policy, batch = _policy_and_bf16_batch()
    batch.policy_version[:] = 0
    spy = _Spy(monkeypatch)
    learner = build_algorithm(AlgoConfig(group_size=4, update_epochs=1, minibatches=2, clip_eps=CLIP,
                                         proximal="loglinear"), copy.deepcopy(policy),
                              behaviour_dtype=torch.bfloat16)
    learner.update(batch, torch.Generator().manual_seed(1), learner_version=2)  # every step 2 versions old
    log_ratio, _, stats = spy.calls[0]
    assert torch.equal(log_ratio, torch.zeros_like(log_ratio)) and stats["clip_frac"] == 0.0


def test_matching_numerics_keep_the_cheap_on_policy_path(monkeypatch):
    """fp32 replicas and an fp32 learner: fresh steps keep their behaviour log-probs (no extra
    forward pass), as before."""
    policy, _ = _policy_and_bf16_batch()
    env = make_env(debug().env, "cpu", seed=0)
    batch = collect_episodes(env, policy, 6, group_size=4, generator=torch.Generator().manual_seed(0))
    passes = []
    real = algo_base.Algorithm.proximal_log_probs
    monkeypatch.setattr(algo_base.Algorithm, "proximal_log_probs",
                        lambda self, *a, **k: passes.append(1) or real(self, *a, **k))
    for dtype in (None, torch.float32):
        learner = build_algorithm(AlgoConfig(group_size=4), copy.deepcopy(policy), behaviour_dtype=dtype)
        assert learner.behaviour_exact
        learner.update(batch, torch.Generator().manual_seed(1), learner_version=0)
    assert passes == []
    exact = {(d, p): build_algorithm(AlgoConfig(group_size=4, precision=p), copy.deepcopy(policy),
                                     behaviour_dtype=d).behaviour_exact
             for d in (torch.float32, torch.bfloat16) for p in ("fp32", "bf16")}
    assert exact == {(torch.float32, "fp32"): True, (torch.float32, "bf16"): False,
                     (torch.bfloat16, "fp32"): False, (torch.bfloat16, "bf16"): False}


def _sharded_worker(rank: int, port: int, out) -> None:
    import traceback
    from functools import partial

    import torch.distributed as dist

    from dvla.distributed import allreduce_mean_grads
    from dvla.distributed.sharding import gathered_weights, shard_learner

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
        policy, batch = _policy_and_bf16_batch(sharpen=5.0)
        if rank == 1:  # a smaller share: rank 1 makes fewer proximal passes and pads them to rank 0's
            rows = batch.valid.nonzero()
            batch.valid[rows[7:, 0], rows[7:, 1]] = False
        acfg = AlgoConfig(group_size=4, lr=1e-2, update_epochs=2, minibatches=2, micro_batch=5, ratio="dim")
        group = dist.new_group([0, 1])
        plain = build_algorithm(acfg, copy.deepcopy(policy), partial(allreduce_mean_grads, group=group),
                                behaviour_dtype=torch.bfloat16)
        sharded = build_algorithm(acfg, copy.deepcopy(policy), behaviour_dtype=torch.bfloat16)
        shard_learner(sharded, group)
        passes = []  # the sharded learner's proximal forward passes, real and padding
        real = sharded._evaluate
        sharded._evaluate = lambda part: passes.append(1) or real(part)
        stats = [learner.update(batch, torch.Generator().manual_seed(1), learner_version=0)
                 for learner in (plain, sharded)]
        whole = dict(gathered_weights(sharded.policy))
        diff = max(float((p.detach() - whole[n]).abs().max()) for n, p in plain.policy.named_parameters())
        out.put((rank, {"diff": diff, "is_weight": [s["is_weight_mean"] for s in stats], "passes": len(passes)}))
        dist.destroy_process_group()
    except BaseException as exc:
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}))


@pytest.mark.slow
def test_sharded_learners_recompute_every_step_in_lock_step():
    """FSDP-sharded learners told of bf16 replicas, rank 1 with a smaller share: every rank
    makes as many proximal passes as the largest share needs (padding), and the update equals
    the all-reducing learners'."""
    from tests.helpers.ranks import spawn_ranks

    res = spawn_ranks(_sharded_worker, 2, timeout=180)
    assert res[0]["passes"] == res[1]["passes"] > 2, res  # rank 1's 7 steps alone take 2 passes of 5
    for r in res.values():
        assert r["diff"] < 1e-5, r
        assert r["is_weight"][0] == pytest.approx(r["is_weight"][1], rel=1e-5) and r["is_weight"][0] != 1.0, r
