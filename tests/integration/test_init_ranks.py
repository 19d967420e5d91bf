"""The normalisation of an SFT run (:mod:`dvla.normalize`) in the RL run that starts from it
(``policy.init``), issue #40: every rank acts with it, not only rank 0 (the others receive it
over the wire at start-up, not from rank 0's files); the RL run keeps its own copy
(``normalization.json``, its weights' and checkpoints' metadata), so that ``--resume`` brings it
back on every rank and ``dvla eval`` finds it after the SFT run is gone; a resume whose stored
normalisation is damaged or missing stops in one line.

One tiny SFT run (fast_reach expert demonstrations, a few steps of ``dvla sft``) is shared by
the module."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from dvla.app.cli import main as cli
from dvla.config import ConfigError, apply_overrides
from dvla.normalize import Normalizer
from dvla.config.presets import get_preset

pytestmark = pytest.mark.xdist_group("init_ranks")

FAST = ["run.progress=false", "run.tensorboard=false", "run.torch_threads=1"]
# The RL runs: small batches of the preset's env and policy (the SFT run's).
RL = [*FAST, "env.n_envs=8", "algo.group_size=4", "algo.update_epochs=1", "algo.minibatches=1"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """``dvla sft`` of fast_reach's policy for 3 steps on 16 expert episodes (about a second)."""
    from dvla.datasets.lerobot_format import write_lerobot
    from dvla.datasets.record import FastReachExpert, record_batch
    from dvla.envs import make_env

    env = make_env(apply_overrides(get_preset("fast_reach"), ["env.n_envs=16"]).env, seed=1)
    base = tmp_path_factory.mktemp("init_ranks")
    write_lerobot(base / "demos", record_batch(env, FastReachExpert(env), max_steps=24), fps=10,
                  robot_type="fast_reach")
    assert cli(["sft", "--data", str(base / "demos"), "--out", str(base / "sft"), "--batch-size", "16", *FAST,
                "run.iterations=3"]) == 0
    return (base / "sft" / "latest").resolve()


def digest_of(run) -> str:
    return Normalizer.from_json((run / "normalization.json").read_text()).digest()


def copy_of(sft_run, tmp_path):
    """A copy of the SFT run, to delete later."""
    return shutil.copytree(sft_run, tmp_path / "sft")


def weights_normalization(path) -> str | None:
    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get("normalization")


def rl(out, *overrides):
    from swimlane import Swimlane

    return Swimlane(apply_overrides(get_preset("fast_reach"), [
        *RL, "swimlane.driver=serial", "swimlane.mode=sync", f"run.out_dir={out}", *overrides]))


@pytest.mark.slow
def test_every_rank_acts_with_the_sft_normalisation_and_a_resume_brings_it_back(sft_run, tmp_path):
    """torchrun, two processes, rank 1 the only one that acts (``swimlane.colocate=false``);
    then ``--resume`` of that run after the SFT run is deleted; then ``dvla eval``'s loader."""
    from dvla.evaluation import load_policy
    from tests.helpers.ranks import torchrun_job

    sft = copy_of(sft_run, tmp_path)
    want = digest_of(sft)
    job = ["swimlane.colocate=false", *RL, "run.save_every=1"]
    run = torchrun_job(tmp_path, "rl", [*job, "run.iterations=2", f"policy.init={sft}"], preset="fast_reach")
    ranks = {0: json.loads((run / "summary.json").read_text()),
             1: json.loads((run / "summary_rank1.json").read_text())}
    assert ranks[1]["role"] == "rollout" and ranks[1]["chunks_sent"] > 0  # rank 1 acted
    assert {r: s.get("normalization") for r, s in ranks.items()} == {0: want, 1: want}
    # the run's own copy: normalization.json, weights.safetensors and its checkpoints
    assert digest_of(run) == want
    text = (run / "normalization.json").read_text()
    assert weights_normalization(run / "weights.safetensors") == text
    manifest = json.loads((run / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    assert manifest["normalization"] == text

    shutil.rmtree(sft)  # policy.init's run is gone; the RL run needs it no longer
    (run / "normalization.json").unlink()  # (written again from the checkpoint on resume)
    torchrun_job(tmp_path, "rl", [*job, "run.iterations=3", f"policy.init={sft}", "run.resume=true"],
                 preset="fast_reach")
    ranks = {0: json.loads((run / "summary.json").read_text()),
             1: json.loads((run / "summary_rank1.json").read_text())}
    assert ranks[0]["resumed_from"] == 2 and ranks[0]["version"] == 3
    assert {r: s.get("normalization") for r, s in ranks.items()} == {0: want, 1: want}
    assert (run / "normalization.json").read_text() == text

    _, policy, stored = load_policy(run)  # dvla eval's loader: the RL run's own weights and normalisation
    assert stored.version == 3 and policy.normalizer is not None and policy.normalizer.digest() == want


def test_a_resumed_run_holds_the_normalisation_exactly_without_the_sft_run(sft_run, tmp_path):
    """One process: the run writes its normalisation at start and into every checkpoint; a
    resume restores it into the policy, the KL reference and the replicas that act, even
    with the SFT run and the run's own normalization.json deleted."""
    from dvla.evaluation import load_policy
    from dvla.state.init_weights import read_weights

    sft, out = copy_of(sft_run, tmp_path), tmp_path / "rl"
    want = Normalizer.from_json((sft / "normalization.json").read_text())
    first = rl(out, "run.iterations=1", "run.save_every=1", "algo.kl_coef=0.1", f"policy.init={sft}")
    first.run()
    assert (out / "normalization.json").read_text() == want.to_json()
    assert weights_normalization(out / "weights.safetensors") == want.to_json()
    shutil.rmtree(sft)
    (out / "normalization.json").unlink()
    lanes = rl(out, "run.iterations=2", "run.save_every=1", "algo.kl_coef=0.1", f"policy.init={sft}",
               "run.resume=true")
    assert lanes.state.resumed_from == 1
    acting = [lanes.policy, lanes.algo.reference, *lanes.parts.weights.replicas]
    for model in acting:
        n = model.normalizer
        assert n is not None and n.to_json() == want.to_json()
        for k in ("proprio_mean", "proprio_std", "action_center", "action_half_range"):
            assert torch.equal(getattr(n, k), getattr(want, k)), k
    summary = lanes.run()
    assert summary["normalization"] == want.digest()
    assert (out / "normalization.json").read_text() == want.to_json()
    _, policy, stored = load_policy(out)
    assert stored.version == 2 and policy.normalizer.to_json() == want.to_json()
    for path in (out / "checkpoints" / "step-00000002", out / "checkpoints" / "step-00000002" / "tensors.safetensors"):
        assert read_weights(path).normalization.to_json() == want.to_json()  # policy.init of a checkpoint


def test_a_run_without_a_normalisation_records_none(tmp_path):
    out = tmp_path / "rl"
    summary = rl(out, "run.iterations=1", "run.save_every=1").run()
    assert summary["normalization"] is None and not (out / "normalization.json").exists()
    manifest = json.loads((out / "checkpoints" / "step-00000001" / "manifest.json").read_text())
    assert manifest["normalization"] is None
    lanes = rl(out, "run.iterations=2", "run.resume=true")
    assert lanes.state.resumed_from == 1 and lanes.policy.normalizer is None


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_resume_whose_normalisation_is_damaged_or_missing_stops_in_one_line(sft_run, tmp_path, damage):
    sft, out = copy_of(sft_run, tmp_path), tmp_path / "rl"
    rl(out, "run.iterations=1", "run.save_every=1", f"policy.init={sft}").run()
    path = out / "checkpoints" / "step-00000001" / "manifest.json"
    manifest = json.loads(path.read_text())
    if damage == "corrupt":
        manifest["normalization"] = '{"proprio_mean": [0.0]'
        words = ["run.resume", str(path.parent), "unreadable normalisation"]
    else:  # a checkpoint that records none (written before checkpoints carried it), its sources gone
        del manifest["normalization"]
        (out / "normalization.json").unlink()
        shutil.rmtree(sft)
        words = ["run.resume", str(path.parent), "records no normalisation", str(sft)]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as got:
        rl(out, "run.iterations=2", f"policy.init={sft}", "run.resume=true")
    assert "\n" not in str(got.value), str(got.value)
    for w in words:
        assert w in str(got.value), (w, str(got.value))
    assert json.loads(path.read_text()) == manifest  # nothing lost


def test_a_checkpoint_from_before_finds_the_normalisation_where_it_did(sft_run, tmp_path):
    """A checkpoint written before checkpoints carried the normalisation: the run's own
    normalization.json, else the run policy.init names."""
    sft, out = copy_of(sft_run, tmp_path), tmp_path / "rl"
    rl(out, "run.iterations=1", "run.save_every=1", f"policy.init={sft}").run()
    path = out / "checkpoints" / "step-00000001" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["normalization"]
    path.write_text(json.dumps(manifest))
    (out / "normalization.json").unlink()
    lanes = rl(out, "run.iterations=2", f"policy.init={sft}", "run.resume=true")
    assert lanes.policy.normalizer.to_json() == (sft / "normalization.json").read_text()
