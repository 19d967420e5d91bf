"""The programs in examples/ run end to end (few iterations), so they cannot silently rot.

Each example runs in a subprocess from a temporary directory, writing only there.
"""

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from dvla.metrics import read_metrics
from dvla.policy import POLICY_REGISTRY
from tests.helpers import ROOT

EXAMPLES = ROOT / "examples"


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def run(cmd, cwd, timeout, env=None):
    """Run ``cmd`` in its own session; on a timeout the whole process group is stopped."""
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} timed out after {timeout}s\n{out[-4000:]}\n{err[-4000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-4000:]}\n{err[-6000:]}"
    return out


def test_custom_policy_meets_the_policy_contract():
    """The example's model passes the contract every registered policy must satisfy."""
    contract = load_module(ROOT / "tests" / "unit" / "dvla" / "test_policies.py", "_examples_policy_contract")
    example = load_module(EXAMPLES / "custom_policy.py", "_examples_custom_policy")
    try:
        assert POLICY_REGISTRY[example.POLICY_NAME] is example.PatchMixVLA
        contract.test_policy_contract(example.POLICY_NAME, {})
        contract.test_policy_contract(example.POLICY_NAME, {"patch": 4, "width": 16})
    finally:
        POLICY_REGISTRY.pop(example.POLICY_NAME, None)
        sys.modules.pop("_examples_custom_policy", None)
        sys.modules.pop("_examples_policy_contract", None)


@pytest.mark.slow
def test_custom_policy_trains_with_the_swimlane(tmp_path):
    out = tmp_path / "custom"
    stdout = run([sys.executable, str(EXAMPLES / "custom_policy.py"), "--iterations", "4", "--out", str(out),
                  "run.torch_threads=1"], cwd=tmp_path, timeout=120)
    updates = [ln for ln in stdout.splitlines() if ln.startswith("update")]
    assert len(updates) == 4 and all("success" in ln for ln in updates), stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["version"] == 4 and summary["error"] is None
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["iter"] for r in rows] == [0, 1, 2, 3]
    assert all(0.0 <= r["success_rate"] <= 1.0 for r in rows)

    with safe_open(out / "weights.safetensors", "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert meta["policy"] == "patch_mix_vla" and meta["version"] == "4"
    assert {"patch_embed.weight", "patch_pos", "word_embed.weight", "query.weight", "mean_head.weight",
            "log_std", "value_head.weight"} <= keys


@pytest.mark.slow
def test_the_transformers_example_meets_the_contract_and_trains(tmp_path):
    """examples/hf_policy.py (a ViT and a Qwen2 decoder from transformers configs, a flow
    action expert): the policy contract, then 4 updates of the program itself, then the
    launcher with ``--import`` (its denoising chains travel as rollout extras)."""
    pytest.importorskip("transformers")
    contract = load_module(ROOT / "tests" / "unit" / "dvla" / "test_policies.py", "_examples_policy_contract")
    example = load_module(EXAMPLES / "hf_policy.py", "_examples_hf_policy")
    try:
        contract.test_policy_contract(example.POLICY_NAME, {"width": 32, "layers": 1})
    finally:
        POLICY_REGISTRY.pop(example.POLICY_NAME, None)
        sys.modules.pop("_examples_hf_policy", None)
        sys.modules.pop("_examples_policy_contract", None)
    out = tmp_path / "hf"
    stdout = run([sys.executable, str(EXAMPLES / "hf_policy.py"), "--iterations", "4", "--out", str(out),
                  "run.torch_threads=1"], cwd=tmp_path, timeout=120)
    assert sum(ln.startswith("update") and "success" in ln for ln in stdout.splitlines()) == 4, stdout
    assert json.loads((out / "summary.json").read_text())["version"] == 4
    launched = tmp_path / "launched"
    run([sys.executable, "-m", "dvla.launch", "--import", str(EXAMPLES / "hf_policy.py"), "--preset", "debug",
         "policy.name=hf_flow_vla", "policy.options={}", "env.image_size=16", "run.iterations=2",
         f"run.out_dir={launched.parent}", f"run.name={launched.name}"], cwd=tmp_path, timeout=120)
    summary = json.loads((launched / "summary.json").read_text())
    assert summary["version"] == 2 and summary["rejected_extras"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_gym_env_trains_on_pendulum(tmp_path, algo):
    out = tmp_path / "gym"
    stdout = run([sys.executable, str(EXAMPLES / "gym_env.py"), "--iterations", "3", "--out", str(out),
                  "--algo", algo, "env.episode_len=20", "run.torch_threads=1"], cwd=tmp_path, timeout=120)
    assert sum(ln.startswith("update") and "return" in ln for ln in stdout.splitlines()) == 3, stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["version"] == 3 and summary["error"] is None
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 3
    for r in rows:  # Pendulum's reward is in [-16.3, 0] per step
        assert r["episode_len_mean"] == 20 and math.isfinite(r["return_mean"]) and -400 < r["return_mean"] <= 0
    config = (out / "config.yaml").read_text()
    assert "gym_id: Pendulum-v1" in config and f"name: {algo}" in config


def test_multinode_dry_run_prints_the_torchrun_command(tmp_path):
    env = {"NNODES": "4", "NODE_RANK": "3", "NPROC_PER_NODE": "8", "RDZV_ENDPOINT": "10.1.2.3:29400",
           "RDZV_ID": "job7", "SAVE_EVERY": "10", "MAX_RESTARTS": "2", "OUT_DIR": "/shared/run"}
    cmd = run(["bash", str(EXAMPLES / "multinode.sh"), "--dry-run", "swimlane.learner_ranks=2"],
              cwd=tmp_path, timeout=30, env=env).split()
    for arg in ["--nnodes=4", "--node_rank=3", "--nproc_per_node=8", "--rdzv_backend=c10d",
                "--rdzv_endpoint=10.1.2.3:29400", "--rdzv_id=job7", "--max-restarts=2", "dvla.launch",
                "run.save_every=10", "run.out_dir=/shared/run", "swimlane.learner_ranks=2"]:
        assert arg in cmd, (arg, cmd)
