"""FSDP2-sharded learners (``algo.shard=fsdp``): the same update as unsharded learners that
all-reduce their gradients, a fraction of the state per rank, and, in a torchrun job, the
weights gathered from the shards reach every inference replica and every checkpoint."""

from __future__ import annotations

import copy
import json
import traceback
from functools import partial

import pytest
import torch
from tests.helpers.ranks import RankPool, torchrun_job

from dvla.algos import build_algorithm
from dvla.config import AlgoConfig, ConfigError, apply_overrides
from dvla.envs import make_env
from dvla.policy import PolicySpec, build_policy
from dvla.config.presets import debug
from dvla.rollout import collect_episodes

TOKEN_VLA = ["policy.name=token_vla", "policy.options={}", "policy.options.n_bins=21", "env.image_size=16",
             'policy.options.vision={"image_size": 16}', "policy.options.lora_rank=4"]
CASES = {
    # algo, ratio, policy overrides, micro_batch, proximal, kl_coef, valid steps kept on rank 1
    "ppo-bins-stale": ("ppo", "joint", ["policy.options.head=bins"], 0, "recompute", 0.0, 40),
    "grpo-flow-micro-kl": ("grpo", "dim", ["policy.options.head=flow"], 5, "recompute", 0.1, 40),
    "grpo-bins-loglinear-empty-minibatches": ("grpo", "step", ["policy.options.head=bins"], 4, "loglinear", 0.0, 3),
    # one FSDP unit per transformer block, its activations recomputed in the backward pass,
    # frozen LoRA base weights beside trainable adapters
    "token-vla-lora-blocks": ("grpo", "dim", TOKEN_VLA, 8, "recompute", 0.0, 20),
}


def _learners(policy, acfg, group, recompute: bool):
    """An unsharded learner (gradients all-reduced) and a sharded one, from the same weights;
    ``recompute``: the sharded one checkpoints its blocks' activations."""
    from dvla.distributed import allreduce_mean_grads
    from dvla.distributed.sharding import checkpoint_activations, shard_learner

    plain = build_algorithm(acfg, copy.deepcopy(policy), partial(allreduce_mean_grads, group=group))
    sharded = build_algorithm(acfg, copy.deepcopy(policy))
    if recompute:
        checkpoint_activations(sharded.policy)
    shard_learner(sharded, group)
    return plain, sharded


def _update_worker(rank: int, port: int, case: str, out) -> None:
    import torch.distributed as dist

    from dvla.distributed.sharding import gathered_weights, is_sharded, local_bytes

    try:
        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
        algo, ratio, overrides, micro, proximal, kl, keep = CASES[case]
        cfg = apply_overrides(debug(), ["policy.action_chunk=3", "env.reward_shaping=1.0", *overrides])
        env = make_env(cfg.env, "cpu", seed=rank)
        torch.manual_seed(0)
        policy = build_policy(cfg.policy.name, PolicySpec.for_env(env.spec, 3), cfg.policy.options)
        batch = collect_episodes(env, policy, 6, group_size=4 if algo == "grpo" else 1,
                                 generator=torch.Generator().manual_seed(rank))
        batch.policy_version[:, ::2] = 1  # half the episodes a version behind: off-policy steps
        if rank == 1:  # a smaller share: rank 1 pads its passes to rank 0's
            rows = batch.valid.nonzero()
            batch.valid[rows[keep:, 0], rows[keep:, 1]] = False
        acfg = AlgoConfig(name=algo, group_size=4, lr=1e-2, update_epochs=2, minibatches=4, kl_coef=kl,
                          ratio=ratio, micro_batch=micro, proximal=proximal)
        group = dist.new_group([0, 1])
        plain, sharded = _learners(policy, acfg, group, recompute=case.startswith("token"))
        stats = []
        for learner in (plain, sharded):
            for version in (2, 3):  # the second update sees moments from the first
                s = learner.update(batch, torch.Generator().manual_seed(version), learner_version=version)
            stats.append(s)
        whole = dict(gathered_weights(sharded.policy))
        diff = max(float((p.detach() - whole[n]).abs().max()) for n, p in plain.policy.named_parameters())
        moved = max(float((p.detach() - q.detach()).abs().max())
                    for p, q in zip(plain.policy.parameters(), policy.parameters()))
        # Adam's moments of the parameters both learners hold them for (the all-reduce gives an
        # unused parameter a zero gradient, hence moments; FSDP leaves it without).
        held = [(plain.optimizer.state[p], sharded.optimizer.state[q]) for p, q in zip(plain.params, sharded.params)
                if sharded.optimizer.state.get(q)]
        full_state = [t for s, _ in held for t in s.values() if t.dim() > 0]
        state = [t for _, s in held for t in s.values() if t.dim() > 0]
        units = sum(is_sharded(u) for u in sharded.policy.shard_units())
        out.put((rank, {"diff": diff, "moved": moved, "stats": stats, "units": units,
                        "bytes": local_bytes([*sharded.policy.parameters(), *state]),
                        "full_bytes": local_bytes([*plain.policy.parameters(), *full_state])}))
        dist.destroy_process_group()
    except BaseException as exc:
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}))


@pytest.fixture(scope="module")
def pool():
    """The cases below share one pair of spawned ranks (each case a process group of its own)."""
    with RankPool() as ranks:
        yield ranks


@pytest.mark.slow
@pytest.mark.xdist_group("sharding_cases")  # one worker, so that they share the pool
@pytest.mark.parametrize("case", list(CASES))
def test_a_sharded_update_equals_the_unsharded_one(case, pool):
    """Two gloo ranks with different shares (rank 1 smaller: padding passes, and empty
    minibatches in the last case), off-policy steps, micro-batches, a KL reference: two
    updates of sharded learners give the weights and diagnostics of learners that
    all-reduce their gradients, and each holds half the weights and Adam moments."""
    res = pool.run(_update_worker, 2, case, timeout=180)
    for rank, r in res.items():
        assert r["units"] == (4 if case.startswith("token") else 0)  # 2 SigLIP + 2 Llama blocks: FSDP units
        assert r["moved"] > 1e-4, r  # the update did something
        assert r["diff"] < 1e-5, (rank, r["diff"])
        plain, sharded = r["stats"]
        for key in ("loss", "policy_loss", "entropy", "grad_norm", "samples"):
            assert sharded[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), (rank, key)
    total = res[0]["full_bytes"]
    assert res[1]["full_bytes"] == total
    # Every parameter and moment is cut in two along its first dimension (an odd one unevenly).
    assert res[0]["bytes"] + res[1]["bytes"] == total
    assert all(0.45 * total < r["bytes"] < 0.55 * total for r in res.values())


def test_sharding_needs_several_learners():
    with pytest.raises(ConfigError, match="algo.shard"):
        apply_overrides(debug(), ["algo.shard=fsdp"]).validate()


@pytest.mark.slow
def test_sharded_learners_publish_and_checkpoint_the_gathered_weights(tmp_path):
    """torchrun: two sharded learners (one rolls out) and a rollout rank. Every inference
    replica ends with the weights the learners hold between them, bit for bit; checkpoints
    hold the whole model; a resumed run, on another layout, reshards them and carries on."""
    from safetensors.torch import load_file

    from dvla.state.checkpoint import CheckpointManager

    run = ["run.iterations=4", "run.save_every=2", "swimlane.learner_ranks=2", "algo.shard=fsdp"]
    out = torchrun_job(tmp_path, "sharded", run, nproc=3)
    summaries = [json.loads((out / f).read_text()) for f in ("summary.json", "summary_rank1.json",
                                                              "summary_rank2.json")]
    # The pool holds each learner's shard of Adam's moments: half of every trainable parameter.
    model_bytes = sum(p.numel() * 4 for p in build_policy("tiny_vla", PolicySpec.for_env(make_env(debug().env, "cpu").spec),
                                                          debug().policy.options).parameters())
    for s in summaries[:2]:
        held = s["memory"]["persistent_tensors"]
        assert 0.45 * model_bytes < held["optimizer/exp_avg"] == held["optimizer/exp_avg_sq"] < 0.55 * model_bytes
        assert "policy" not in held  # FSDP holds the weights' shards
    digest = summaries[0]["weights_digest"]
    assert summaries[1]["weights_digest"] == digest  # the learners' gathered shards agree
    for s in summaries:
        assert s["replica_version"] == 4 and s["replica_digest"] == digest, s.get("replica_digest")
    env = make_env(debug().env, "cpu")
    shapes = {k: v.shape for k, v in build_policy("tiny_vla", PolicySpec.for_env(env.spec),
                                                  debug().policy.options).state_dict().items()}
    ck = CheckpointManager(out / "checkpoints").load_latest()
    assert ck.manifest["version"] == 4
    policy = {k[7:]: v for k, v in ck.tensors.items() if k.startswith("policy/")}
    assert {k: v.shape for k, v in policy.items()} == shapes  # whole tensors, not shards
    final = load_file(out / "weights.safetensors")
    assert all(torch.equal(final[k], v) for k, v in policy.items())
    param_shapes = ck.manifest["optimizer"]["param_shapes"]
    moments = {int(k.split("/")[1]): v for k, v in ck.tensors.items() if k.startswith("optim/") and k.endswith("exp_avg")}
    assert moments and all(list(v.shape) == param_shapes[i] for i, v in moments.items())

    # Resumed on four ranks, the learners now learning only (swimlane.colocate=false) and
    # publishing in bf16: each tensor is cast to bf16 before it is gathered, and the rollout
    # ranks' replicas hold the learners' weights in bf16, bit for bit. Rank 0 holds its shards
    # and the snapshot it publishes from, rank 1 its shards only (it relays each version
    # through scratch buffers).
    out = torchrun_job(tmp_path, "sharded", [*run[1:], "run.iterations=6", "run.resume=true",
                                             "swimlane.publish_dtype=bf16", "swimlane.colocate=false"], nproc=4)
    s = [json.loads((out / f).read_text()) for f in ("summary.json", "summary_rank1.json", "summary_rank2.json",
                                                      "summary_rank3.json")]
    assert s[0]["resumed_from"] == 4 and s[0]["version"] == 6
    assert s[0]["published_digest"] != s[0]["weights_digest"]
    tags = [set(r["memory"]["persistent_tensors"]) for r in s]
    assert tags[0] == {"broadcast/bucket0", "optimizer/exp_avg", "optimizer/exp_avg_sq"}
    assert tags[1] == {"optimizer/exp_avg", "optimizer/exp_avg_sq"}  # no replica, no bucket
    assert s[1]["broadcast_traffic"]["flat_received"] == 3  # versions 4-6, relayed
    for r in s[2:]:
        assert r["role"] == "rollout" and r["replica_version"] == 6 and r["replica_digest"] == s[0]["published_digest"]


@pytest.mark.slow
def test_sharded_bf16_learners_learn_fast_reach(tmp_path):
    """torchrun, two sharded learners that also roll out, bf16 parameters and compute (fp32
    master weights, gradient reduction and optimizer state): every update finite, success
    rises on a fixed seed, and each learner holds about half of the weights and Adam moments.
    18 updates: success 0.11 -> 0.71 (first and last 5; 25 updates, 0.11 -> 0.95, took 7 s more)."""
    from dvla.config.presets import fast_reach

    out = torchrun_job(tmp_path, "bf16", ["run.iterations=18", "swimlane.learner_ranks=2", "algo.shard=fsdp",
                                          "algo.precision=bf16", "swimlane.mode=sync", "env.image_size=16",
                                          "env.n_envs=32"], preset="fast_reach", timeout=300)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 18 and all(r["non_finite_steps"] == 0 for r in rows)
    success = [r["success_rate"] for r in rows]
    assert sum(success[-5:]) / 5 > sum(success[:5]) / 5 + 0.3, success
    cfg = fast_reach()
    model = build_policy("tiny_vla", PolicySpec.for_env(make_env(cfg.env, "cpu").spec), cfg.policy.options)
    whole = 3 * sum(p.numel() * 4 for p in model.parameters())  # fp32 weights and two moments
    assert 0.4 * whole < rows[-1]["learner_state_bytes"] < 0.6 * whole


def test_a_policy_whose_output_hides_its_tensors_from_fsdp_is_an_error(tmp_path, monkeypatch):
    """Without the distribution's tensors among the forward's outputs, FSDP's backward hooks
    never fire and the gradients stay whole on every rank: the update says so instead of
    stepping on unsynchronised gradients (a group of one process is enough to see it)."""
    import torch.distributed as dist

    import dvla.distributed.sharding as sharding

    monkeypatch.setattr(sharding, "_anchor_distribution", lambda module, args, output: output)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        cfg = debug()  # GRPO, no value head: the distribution is the only path to the loss
        env = make_env(cfg.env, "cpu", seed=0)
        policy = build_policy("tiny_vla", PolicySpec.for_env(env.spec), cfg.policy.options)
        batch = collect_episodes(env, policy, 4, group_size=4, generator=torch.Generator().manual_seed(0))
        algo = build_algorithm(AlgoConfig(name="grpo", group_size=4), policy)
        sharding.shard_learner(algo, dist.group.WORLD)
        with pytest.raises(RuntimeError, match="did not reduce-scatter"):
            algo.update(batch, torch.Generator().manual_seed(0))
    finally:
        dist.destroy_process_group()
