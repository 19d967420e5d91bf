"""``dvla sft`` on several ranks (torchrun, real processes, gloo on the CPU) and resumable:
the global minibatches are the same whatever the number of ranks and each rank trains on its
own share; two ranks (replicated, gradients all-reduced) follow one rank's loss curve and end
with its weights; two FSDP-sharded ranks checkpoint whole tensors, resume (resharded) onto the
same curve and leave a run directory that ``policy.init`` and ``dvla eval`` load; a resume goes
on bit for bit, past a damaged checkpoint, with the random streams restored; what a resume
cannot change is a one-line error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dvla.state.checkpoint import CheckpointManager
from dvla.metrics import TORN_LINE
from dvla.app.cli import main as cli
from dvla.datasets.frames import GlobalBatches, shard
from tests.unit.dvla.test_sft import FAST, data, one_line, sft  # noqa: F401 (data: the fast_reach demonstrations fixture)

# Shares of different sizes (16 and 15 frames) and masked steps (chunks of 2): the weighting
# of each rank's loss by its share of the valid steps is what makes two ranks equal one.
SMALL = ["--batch-size", "31", "policy.action_chunk=2"]


def torchrun(tmp: Path, module: str, *args: str, nproc: int = 2, timeout: float = 240) -> Path:
    """``torchrun --standalone --nproc_per_node=N -m MODULE sft ...`` into base ``tmp``; its run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module,
           "sft", "--out", str(tmp), *FAST, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("done: ") == 1  # rank 0 alone reports (and writes)
    return (tmp / "latest").resolve()


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "weights.safetensors"))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def damage(checkpoint: Path) -> None:
    """Flip a byte in the middle of a checkpoint's tensors (its sha256 no longer matches)."""
    path = checkpoint / "tensors.safetensors"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def one_rank(data, tmp_path_factory):
    """The reference: 8 steps in one process."""
    return sft(tmp_path_factory.mktemp("one"), data, *SMALL, "run.iterations=8")


def test_the_global_batches_are_the_same_whatever_the_world_and_the_shares_cover_them():
    want = GlobalBatches(50, 16, seed=3)
    first = [want.next() for _ in range(9)]  # (3 a permutation: a fresh one every 3 batches)
    assert all(len(b) == 16 for b in first) and len(set(np.concatenate(first[:3]).tolist())) == 48
    again = GlobalBatches(50, 16, seed=3)
    again.skip(5)  # a resume's replay
    assert all(np.array_equal(again.next(), b) for b in first[5:])
    for world in (1, 2, 3, 16):
        parts = [shard(first[0], r, world) for r in range(world)]
        assert np.array_equal(np.concatenate(parts), first[0]) and max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.slow
def test_two_ranks_follow_one_ranks_loss_curve_to_its_weights(data, one_rank, tmp_path):
    """torchrun, two ranks, the model replicated (``algo.shard=none``): the same global batches,
    each rank's share, the gradients averaged. (~15 s)"""
    two = torchrun(tmp_path / "two", "dvla.launch", "--data", str(data), *SMALL, "run.iterations=8", "algo.shard=none")
    assert json.loads((two / "summary.json").read_text())["world_size"] == 2
    a, b = rows(one_rank), rows(two)
    assert [r["iter"] for r in b] == list(range(8))
    assert np.allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=1e-6, atol=0), (a, b)
    assert np.allclose([r["grad_norm"] for r in a], [r["grad_norm"] for r in b], rtol=1e-5)
    assert max_diff(weights(one_rank), weights(two)) < 1e-4  # (measured: 2e-5; Adam's steps are 1e-3)


@pytest.mark.slow
def test_fsdp_ranks_checkpoint_whole_tensors_resume_resharded_and_leave_a_run_that_loads(data, one_rank, tmp_path):
    """torchrun, two ranks, FSDP2 (``algo.shard`` auto: several ranks shard, as RL learners do):
    4 steps, then ``--resume`` to 8 (through ``dvla.app.cli``); the curve and weights are one
    rank's; ``policy.init`` and ``dvla eval``'s loader take the run. (~30 s)"""
    from dvla.envs import env_spec, make_env
    from dvla.evaluation import load_policy
    from dvla.state.init_weights import load_init
    from dvla.policy import PolicySpec, build_policy

    base = tmp_path / "fsdp"
    run = torchrun(base, "dvla.launch", "--data", str(data), *SMALL, "run.iterations=4", "run.save_every=2")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["shard"] == "fsdp" and summary["world_size"] == 2
    ck = CheckpointManager(run / "checkpoints").load_latest()
    assert ck.step == 4 and len(ck.manifest["rank_rng"]) == 1  # rank 1's random streams too
    whole = {k[7:]: v.shape for k, v in ck.tensors.items() if k.startswith("policy/")}
    assert whole == {k: v.shape for k, v in weights(one_rank).items()}  # gathered, not shards
    assert run == torchrun(base, "dvla.cli", "--data", str(data), *SMALL, "run.iterations=8", "run.save_every=2",
                           "--resume")
    b = rows(run)
    assert [r["iter"] for r in b] == list(range(8))
    assert np.allclose([r["loss"] for r in rows(one_rank)], [r["loss"] for r in b], rtol=1e-6, atol=0)
    assert max_diff(weights(one_rank), weights(run)) < 1e-4
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == 4
    cfg, evaluated, stored = load_policy(run)  # dvla eval's loader
    assert stored.version == 8 and cfg.swimlane.learner_ranks == 2
    fresh = build_policy("tiny_vla", PolicySpec.for_env(env_spec(cfg.env), 2), cfg.policy.options)
    assert "version 8" in load_init(fresh, run, "tiny_vla")
    assert fresh.normalizer.to_json() == (run / "normalization.json").read_text()
    obs = make_env(cfg.env, seed=3).reset()
    assert torch.equal(fresh.act(obs, deterministic=True).actions, evaluated.act(obs, deterministic=True).actions)


def test_a_resume_goes_on_bit_for_bit_past_a_damaged_checkpoint(data, tmp_path, capsys):
    """The flow head (its loss draws times and noise): 12 steps straight, against 8 steps
    (checkpoints at 4 and 8), the one at 8 damaged, then ``--resume`` to 12 from the one at 4."""
    flow = [*SMALL, "policy.options.head=flow", "run.save_every=4"]
    straight = sft(tmp_path / "straight", data, *flow, "run.iterations=12")
    err = capsys.readouterr().err
    ticks = [line for line in err.splitlines() if line.startswith("dvla sft: step ")]
    assert len(ticks) == 12 and "frames/s, eta " in ticks[0] and ticks[-1].startswith("dvla sft: step 12/12: loss ")
    stopped = sft(tmp_path / "stopped", data, *flow, "run.iterations=8")
    assert [p.name for p in CheckpointManager(stopped / "checkpoints").list()] == ["step-00000004", "step-00000008"]
    damage(stopped / "checkpoints" / "step-00000008")
    with open(stopped / "metrics.jsonl", "a") as f:
        f.write('{"iter": 8, "lo')  # and a crash mid-write: the RL resume's warning (test_rundir.py)
    capsys.readouterr()
    assert sft(tmp_path / "stopped", data, *flow, "run.iterations=12", "--resume") == stopped
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "step-00000008" in err and "resuming from" in err
    assert TORN_LINE.format(path=stopped / "metrics.jsonl", line=9) in err, err
    assert [r["iter"] for r in rows(stopped)] == list(range(12))  # the rows after step 4 written again, once
    a, b = weights(straight), weights(stopped)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in rows(straight)] == [r["loss"] for r in rows(stopped)]


def test_what_a_resume_cannot_do_is_a_one_line_error(data, tmp_path, capsys):
    def fails(*args: str) -> str:
        assert cli(["sft", "--data", str(data), "--out", str(tmp_path / "base"), *FAST, *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("dvla sft: error: "), err
        return one_line(err)

    assert "no run to continue" in fails("--resume")
    run = sft(tmp_path / "base", data, "--batch-size", "8", "run.iterations=2")
    capsys.readouterr()
    assert "run.iterations=2 but the checkpoint is at update 2" in fails("--batch-size", "8", "run.iterations=2",
                                                                         "--resume")
    assert "cannot change --batch-size" in fails("--batch-size", "9", "run.iterations=3", "--resume")
    assert "cannot change policy.action_chunk" in fails("--batch-size", "8", "run.iterations=3", "--resume",
                                                        "policy.action_chunk=2")
    damage(run / "checkpoints" / "step-00000002")
    assert "no valid checkpoint" in fails("--batch-size", "8", "run.iterations=3", "--resume")
    assert "algo.shard=fsdp shards the model over the ranks" in fails("algo.shard=fsdp")
