"""``policy.init``: an RL run starts from another run's weights (an SFT run's), and GRPO's
KL reference is those weights; weights that do not fit are one line and exit code 2
through ``python -m dvla.launch``. One short trained run is shared by the module."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dvla.state.checkpoint import save_weights
from dvla.config import ConfigError, apply_overrides
from dvla.config.presets import debug

pytestmark = pytest.mark.xdist_group("policy_init")

FAST = ["swimlane.driver=serial", "swimlane.mode=sync", "run.tensorboard=false", "run.torch_threads=1",
        "run.progress=false"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A run of one update (weights.safetensors and a checkpoint of version 1)."""
    from swimlane import Swimlane

    run = tmp_path_factory.mktemp("sft") / "run"
    Swimlane(apply_overrides(debug(), [*FAST, f"run.out_dir={run}", "run.iterations=1", "run.save_every=1"])).run()
    return run


def build(*overrides):
    from swimlane import Swimlane

    return Swimlane(apply_overrides(debug(), [*FAST, *overrides]))


def assert_same(state, expected):
    assert state.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(state[k], v), k


def test_an_rl_run_starts_from_the_sft_runs_weights_and_kl_reference(sft_run, tmp_path, caplog):
    sft = load_file(str(sft_run / "weights.safetensors"))
    with caplog.at_level("INFO", logger="dvla.swimlane"):
        lanes = build(f"run.out_dir={tmp_path / 'rl'}", "run.seed=5", "algo.kl_coef=0.1", f"policy.init={sft_run}")
    assert_same(lanes.policy.state_dict(), sft)
    assert_same(lanes.algo.reference.state_dict(), sft)  # the KL keeps the policy near the SFT one
    assert_same({k: v.float() for k, v in lanes.parts.snapshot.state_dict().items()}, sft)  # what version 0 publishes
    assert f"policy.init: loaded {sft_run}" in caplog.text and "policy tiny_vla, version 1" in caplog.text
    # without policy.init the same run starts elsewhere (so the comparison above can fail)
    fresh = build(f"run.out_dir={tmp_path / 'fresh'}", "run.seed=5", "algo.kl_coef=0.1").policy.state_dict()
    assert any(not torch.equal(fresh[k], v) for k, v in sft.items())


def test_a_file_or_a_checkpoint_directory_works_too(sft_run, tmp_path):
    from dvla.state.init_weights import read_weights

    ck = read_weights(sft_run / "checkpoints" / "step-00000001")
    assert ck.policy == "tiny_vla" and ck.version == 1
    assert_same(ck.tensors, load_file(str(sft_run / "weights.safetensors")))
    file = read_weights(sft_run / "checkpoints" / "step-00000001" / "tensors.safetensors")  # policy/ section
    assert_same(file.tensors, ck.tensors)
    lanes = build(f"run.out_dir={tmp_path / 'rl'}", "run.seed=5", f"policy.init={sft_run / 'weights.safetensors'}")
    assert_same(lanes.policy.state_dict(), ck.tensors)


def test_weights_that_cannot_be_read_are_one_line_errors(sft_run, tmp_path):
    (tmp_path / "notes.safetensors").write_text("not weights\n")
    (tmp_path / "empty").mkdir()
    for init, words in ((tmp_path / "nope", "does not exist"), (tmp_path / "notes.safetensors", "not a readable"),
                        (tmp_path / "empty", "holds no weights")):
        with pytest.raises(ConfigError, match=words) as got:
            build(f"run.out_dir={tmp_path / 'rl'}", f"policy.init={init}")
        assert str(got.value).startswith(f"policy.init: {init}") and "\n" not in str(got.value)
    with pytest.raises(ConfigError, match="policy.init: an empty path"):
        apply_overrides(debug(), ["policy.init="]).validate()


def test_a_normalisation_that_does_not_fit_the_policy_is_a_one_line_error(sft_run, tmp_path):
    import shutil

    from dvla.normalize import FILE, Normalizer

    run = tmp_path / "sft"
    shutil.copytree(sft_run, run)
    (run / FILE).write_text(Normalizer(proprio_mean=torch.zeros(5), proprio_std=torch.ones(5)).to_json())
    with pytest.raises(ConfigError, match="normalisation has 5 proprio dimensions") as got:
        build(f"run.out_dir={tmp_path / 'rl'}", f"policy.init={run}")
    assert str(got.value).startswith(f"policy.init: {run}") and "\n" not in str(got.value)


def launch(*args, cwd):
    return subprocess.run([sys.executable, "-m", "dvla.launch", "--preset", "debug", *FAST, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize("case", ["policy name", "shapes"])
def test_weights_of_another_policy_or_shape_stop_the_launcher_in_one_line(sft_run, tmp_path, case):
    if case == "policy name":
        other = tmp_path / "other.safetensors"
        save_weights(torch.nn.Linear(2, 2), other, 3, policy="some_vla")
        args, words = [f"policy.init={other}"], [str(other), "'some_vla'", "policy.name is 'tiny_vla'"]
    else:
        args = [f"policy.init={sft_run}", "policy.options.hidden_dim=48"]
        words = [str(sft_run / "weights.safetensors"), "shapes differ", "(32,) in the file, (48,) here"]
    proc = launch(*args, f"run.out_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dvla: error: policy.init: "), proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_a_resume_may_drop_or_change_policy_init_but_not_the_policy():
    """A resumed run continues from its checkpoint: the weights it started from no longer
    matter, so changing ``policy.init`` is no reason to refuse; the policy's own options are."""
    from dvla.state.rundir import check_resume_config

    old = {"policy": {"name": "tiny_vla", "init": "/runs/sft", "options": {}}, "run": {"iterations": 10}}
    assert check_resume_config(old, {**old, "policy": {**old["policy"], "init": None}}, done=5) == []
    with pytest.raises(ConfigError, match="policy.options.hidden_dim"):
        check_resume_config(old, {**old, "policy": {**old["policy"], "options": {"hidden_dim": 48}}}, done=5)
