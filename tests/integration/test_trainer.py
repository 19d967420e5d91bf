"""End-to-end synchronous training (the serial driver), learning on the fast env, and the
launch entry points."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dvla.config import apply_overrides
from dvla.envs import make_env
from dvla.metrics import read_metrics
from dvla.config.presets import fast_reach
from dvla.rollout import evaluate
from swimlane import Swimlane

SERIAL = ["swimlane.mode=sync", "swimlane.driver=serial"]


def test_debug_run_writes_metrics_config_and_weights(debug_cfg, tmp_path):
    summary = Swimlane(apply_overrides(debug_cfg, SERIAL)).run()
    out = tmp_path / "run"
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["iter"] for r in rows] == [0, 1, 2]
    for key in ("env_steps_per_s", "success_rate", "return_mean", "loss", "approx_kl", "version"):
        assert key in rows[-1]
    assert rows[-1]["version"] == 3 and summary["version"] == 3
    assert rows[-1]["env_steps"] == summary["env_steps"] > 0
    weights = load_file(str(out / "weights.safetensors"))
    assert any(k.startswith("action_head") for k in weights)
    assert (out / "config.yaml").exists() and json.loads((out / "summary.json").read_text())["iterations"] == 3


def test_ppo_debug_run(debug_cfg):
    cfg = apply_overrides(debug_cfg, ["algo.name=ppo", *SERIAL])
    summary = Swimlane(cfg).run()
    assert summary["version"] == 3


@pytest.mark.slow
def test_success_rate_rises_on_fast_env(tmp_path):
    """Train briefly on a fixed seed; the success rate of the trained policy must beat
    that of the initial policy, both measured on the same fresh episodes of an env of
    their own."""
    cfg = apply_overrides(
        fast_reach(), ["run.iterations=15", "env.image_size=16", "run.progress=false", f"run.out_dir={tmp_path}",
                       *SERIAL])
    torch.set_num_threads(2)
    lanes = Swimlane(cfg)
    eval_env = make_env(cfg.env, torch.device("cpu"), seed=12345)

    def score():
        return evaluate(eval_env, lanes.policy, cfg.env.episode_len, 4, generator=torch.Generator().manual_seed(7))

    before = score()
    lanes.run()
    after = score()
    assert after["success_rate"] > before["success_rate"] + 0.08, (before, after)
    assert after["return_mean"] > before["return_mean"]


def _run(cmd, tmp_path, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_launch_module(tmp_path):
    proc = _run([sys.executable, "-m", "dvla.launch", "--preset", "debug", "run.iterations=2",
                 f"run.out_dir={tmp_path / 'a'}"], tmp_path)
    run = tmp_path / "a" / "latest"  # each launch writes a run directory of its own under run.out_dir
    assert f"dvla report {tmp_path / 'a'}/" in proc.stdout
    assert json.loads((run / "summary.json").read_text())["version"] == 2
    assert len(read_metrics(run / "metrics.jsonl")) == 2


def test_launch_bad_config_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dvla.launch", "--preset", "debug", "env.n_envs=-3"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "env.n_envs: must be >= 1, got -3" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_torchrun_launch(tmp_path):
    """One process under torchrun; tests/unit/dvla/test_rundir.py's torchrun test checks the same on
    its job of two (one job for both)."""
    nproc = 1
    out = tmp_path / "t"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
          "-m", "dvla.launch", "--preset", "debug", "run.iterations=2", f"run.out_dir={tmp_path}",
          f"run.name={out.name}"], tmp_path)
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2
    assert rows[-1]["world_size"] == nproc
