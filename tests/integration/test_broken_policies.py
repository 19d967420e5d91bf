"""A policy that breaks the contract in a job is named at its first batch (issue #47, 4): one
line, exit 2, naming the policy and what is wrong, in one process and on three ranks (where
the rollout ranks find it, the first to do so says it, and the others stay quiet)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

PLUGIN = '''
import dataclasses

import torch

from dvla.models.tiny_vla import TinyVLA
from dvla.policy import register_policy


@register_policy("nan_vla")
class NanVLA(TinyVLA):
    """Acts NaN."""

    def act(self, obs, *args, **kwargs):
        out = super().act(obs, *args, **kwargs)
        return dataclasses.replace(out, actions=torch.full_like(out.actions, float("nan")))


@register_policy("short_vla")
class ShortVLA(TinyVLA):
    """Acts one action dimension short."""

    def act(self, obs, *args, **kwargs):
        out = super().act(obs, *args, **kwargs)
        return dataclasses.replace(out, actions=out.actions[..., :-1])
'''


def _launch(tmp_path, policy: str, nproc: int = 1, launcher=None) -> subprocess.CompletedProcess:
    """The job, one process forked by ``launcher`` (tests/helpers/forks.py) or ``nproc`` under torchrun."""
    (tmp_path / "broken_plugin.py").write_text(PLUGIN)
    args = ["--import", "broken_plugin", "--preset", "debug", f"policy.name={policy}", "run.iterations=50",
            "run.tensorboard=false", *(["swimlane.colocate=false"] if nproc > 1 else [])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tmp_path)}
    if nproc == 1:
        return launcher.run("dvla.launch", args, cwd=tmp_path, timeout=120, env=env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "dvla.launch", *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)


def _the_line(proc, torchrun: bool = False) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("dvla:")]
    # (torchrun itself ends a failed job with a traceback of its own, ChildFailedError)
    assert len(lines) == 1 and proc.stderr.count("Traceback") == int(torchrun), proc.stderr[-4000:]
    return lines[0]


@pytest.mark.parametrize("policy, problem", [("nan_vla", r"actions are not finite"),
                                             ("short_vla", r"actions has shape \((\d+), 1, 1\), not \(\1, 1, 2\)")])
def test_a_policy_that_acts_nan_or_in_the_wrong_shape_is_named_at_its_first_batch(tmp_path, launcher, policy,
                                                                                    problem):
    proc = _launch(tmp_path, policy, launcher=launcher)
    assert proc.returncode == 2, proc.stderr[-4000:]
    line = _the_line(proc)
    # (the first batch: one env group's requests, or both groups' when they came together)
    assert f"policy {policy!r}" in line and re.search(problem, line) and "check-policy" in line, line


@pytest.mark.slow
def test_on_three_ranks_the_broken_policy_is_one_line_and_every_rank_exits_2(tmp_path):
    proc = _launch(tmp_path, "nan_vla", nproc=3)
    line = _the_line(proc, torchrun=True)
    assert "policy 'nan_vla'" in line and "actions are not finite" in line, line
    assert "lost" not in proc.stderr, proc.stderr[-4000:]
    # torchrun's table: exit 2, and no rank reports a failure of its own (exit 1)
    assert "exitcode  : 2" in proc.stderr and "exitcode  : 1" not in proc.stderr, proc.stderr[-4000:]
