"""``dvla check-policy`` and :func:`dvla.contract.check_policy`: the contract a model author
runs. Every registered policy passes it in ``tests/unit/dvla/test_policies.py`` (``test_policy_contract``
calls the same function over the registry and its head modes); here a model with dropout
passes it (dvla samples and learns in eval mode), and for each rule a policy that breaks it
fails that check with what failed and what to do."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from dvla.contract import BF16_TOLERANCE, assert_policy_contract, check_policy
from dvla.distributions import ExtraSpec, GaussianActionDistribution
from dvla.policy import PolicyOutput, PolicySpec, VLAPolicy
from tests.helpers import ROOT

REPO = ROOT
SPEC = PolicySpec(image_shape=(3, 8, 8), proprio_dim=3, action_dim=2, action_chunk=2)
FAST = {"entropy_samples": 64}


class Small(VLAPolicy):
    """Image colour means, proprio and the mean instruction embedding -> an MLP (with dropout
    when asked, as ACT has by default) -> a Gaussian over the chunk, and a value."""

    @dataclass(kw_only=True)
    class Config:
        width: int = 16
        dropout: float = 0.0

    has_value_head = True

    def __init__(self, spec, config):
        super().__init__(spec, config)
        n = spec.action_chunk * spec.action_dim
        self.embed = nn.Embedding(1024, 8, padding_idx=0)
        self.net = nn.Sequential(nn.Linear(spec.image_shape[0] + spec.proprio_dim + 8, config.width), nn.Tanh(),
                                 nn.Dropout(config.dropout), nn.Linear(config.width, n))
        self.value_net = nn.Linear(config.width, 1)
        self.log_std = nn.Parameter(torch.randn(n) * 0.1 - 1.0)

    def features(self, obs):
        mask = obs.instruction_mask.unsqueeze(-1).float()
        lang = (self.embed(obs.instruction_ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        pix = obs.image.float().mean(dim=(2, 3)) / 255.0
        return torch.cat([pix, self.proprio_of(obs), lang], dim=-1)

    def proprio_of(self, obs):
        return obs.proprio.float()

    def head(self, obs):
        return self.net(self.features(obs))

    def mean_of(self, h):
        return torch.tanh(h)

    def forward(self, obs):
        h = self.head(obs)
        mean = self.mean_of(h).view(-1, self.spec.action_chunk, self.spec.action_dim)
        z = self.net[:3](self.features(obs))
        return PolicyOutput(dist=GaussianActionDistribution(mean, self.log_std.view_as(mean[0])),
                            value=self.value_net(z).squeeze(-1))


# -- one policy per rule, each breaking it --------------------------------------------------


class BadInit(Small):
    def __init__(self, spec, config):
        super().__init__(spec, config)
        raise RuntimeError("no weights here")


class ReturnsTensor(Small):
    def forward(self, obs):
        return super().forward(obs).dist.mean


class FlatActions(Small):
    def forward(self, obs):
        out = super().forward(obs)
        return PolicyOutput(GaussianActionDistribution(out.dist.mean.flatten(1), out.dist.log_std.flatten(1)), out.value)


class UndeclaredExtras(Small):
    def rollout_extras(self):
        return {"noise": ExtraSpec((2,))}


class NanLogStd(Small):
    def forward(self, obs):
        out = super().forward(obs)
        return PolicyOutput(GaussianActionDistribution(out.dist.mean, out.dist.log_std * math.nan), out.value)


class GlobalRNG(GaussianActionDistribution):
    def sample(self, generator=None):  # ignores the generator
        return self.mean + torch.randn(self.mean.shape) * self.log_std.exp()


class SamplesGlobally(Small):
    def forward(self, obs):
        out = super().forward(obs)
        return PolicyOutput(GlobalRNG(out.dist.mean, out.dist.log_std), out.value)


class AlwaysSamples(GaussianActionDistribution):
    def draw(self, deterministic=False, generator=None):
        return super().draw(False, generator)


class NoMode(Small):
    def forward(self, obs):
        out = super().forward(obs)
        return PolicyOutput(AlwaysSamples(out.dist.mean, out.dist.log_std), out.value)


class Unsquashed(Small):
    def mean_of(self, h):
        return 5.0 + h


class GradDependent(Small):
    def mean_of(self, h):
        return torch.tanh(h) + (0.1 if torch.is_grad_enabled() else 0.0)


class ZeroEntropy(GaussianActionDistribution):
    def entropy(self, extras=None):
        return torch.zeros(self.mean.shape[0])


class WrongEntropy(Small):
    def forward(self, obs):
        out = super().forward(obs)
        return PolicyOutput(ZeroEntropy(out.dist.mean, out.dist.log_std), out.value)


class Detached(Small):
    def __init__(self, spec, config):
        super().__init__(spec, config)
        self.has_value_head = False

    def forward(self, obs):
        out = super().forward(obs)
        return PolicyOutput(GaussianActionDistribution(out.dist.mean.detach(), out.dist.log_std.detach()))


class ClaimsAValue(Small):
    def forward(self, obs):
        out = super().forward(obs)
        out.value = None
        return out


class Deaf(Small):
    def features(self, obs):
        f = super().features(obs)
        return torch.cat([f[:, :-8], torch.zeros_like(f[:, -8:])], dim=-1)


class BatchNormalised(Small):
    def proprio_of(self, obs):
        return obs.proprio.float() - obs.proprio.float().mean(0)


class Bf16Fragile(Small):
    def mean_of(self, h):  # an offset that bf16 cannot resolve a small mean against
        return torch.tanh((h + 256.0) - 256.0)


class ClosesOverSelf(Small):
    def __init__(self, spec, config):
        super().__init__(spec, config)
        self.scale = lambda: self.log_std  # a copy's lambda still reads the original's weights

    def forward(self, obs):
        out = super().forward(obs)
        return PolicyOutput(GaussianActionDistribution(out.dist.mean, self.scale().view_as(out.dist.mean[0])),
                            out.value)


class PlainTensor(Small):
    def __init__(self, spec, config):
        super().__init__(spec, config)
        self.offset = torch.randn(spec.action_chunk * spec.action_dim) * 0.5  # neither parameter nor buffer

    def mean_of(self, h):
        return torch.tanh(h + self.offset)


class _ShiftedWhenTempered(GaussianActionDistribution):
    def tempered(self, temperature):  # scales the mean as well as the spread
        return GaussianActionDistribution(self.mean * temperature, self.log_std + math.log(temperature))


class MovesItsModeWhenTempered(Small):
    def forward(self, obs):
        out = super().forward(obs)
        return PolicyOutput(_ShiftedWhenTempered(out.dist.mean, out.dist.log_std), out.value)


RULES = [  # policy, the rule it breaks, what its check says, other checks the break fails (the rest pass or skip)
    (BadInit, "builds", "raised RuntimeError: no weights here (at test_check_policy.py"),
    (ReturnsTensor, "forward", "forward returned Tensor, not PolicyOutput"),
    (FlatActions, "forward", "GaussianActionDistribution.draw() raised IndexError: Dimension out of range"),
    (UndeclaredExtras, "rollout_extras", "the head draws extras [], rollout_extras() declares ['noise']"),
    (NanLogStd, "act", "actions are not finite: [nan, nan"),
    (SamplesGlobally, "seeded", "generators of the same seed drew different actions", ["replica"]),
    (NoMode, "deterministic", "act(deterministic=True) drew different actions under generators of other seeds"),
    (Unsquashed, "action_range", "deterministic actions reach"),
    (GradDependent, "evaluate", "evaluate() of act()'s actions differs from act()'s log-probs by up to"),
    (WrongEntropy, "entropy", "minus the mean log-prob of 64 samples is"),
    (MovesItsModeWhenTempered, "temperature", "at temperature 0.5 the most likely actions move by"),
    (Detached, "gradients", "has no gradient at all"),
    (ClaimsAValue, "value_head", "has_value_head is True but evaluate() values are None"),
    (Deaf, "language", "other instructions leave the log-probs of the same actions unchanged"),
    (BatchNormalised, "batch_rows", "a row scored alone differs from the same row in a batch of 4"),
    (Bf16Fragile, "bf16", "a bf16 replica's log-probs and the fp32 learner's of the same actions differ"),
    (ClosesOverSelf, "replica", "a deep copy given another build's weights scores"),
    (PlainTensor, "state_dict", "another build loaded with this policy's state_dict scores", ["replica"]),
]


@pytest.mark.parametrize("rule", RULES, ids=[r[0].__name__ for r in RULES])
def test_a_policy_that_breaks_a_rule_fails_that_check_saying_what_to_do(rule):
    cls, check, says, *also = rule
    report = check_policy(cls, SPEC, **FAST)
    assert sorted(r.name for r in report.failures) == sorted([check, *(also[0] if also else [])]), str(report)
    result = report[check]
    assert says in result.detail, result.line()
    assert result.fix and f". Fix: {result.fix}" in result.line()
    with pytest.raises(AssertionError) as err:
        assert_policy_contract(cls, SPEC, **FAST)
    assert err.value.args[0].splitlines()[0] == report.summary() and result.line() in str(err.value)


def test_a_model_with_dropout_passes_in_dvlas_modes():
    report = assert_policy_contract(Small, SPEC, {"dropout": 0.1}, **FAST)
    assert report["modes"].detail.startswith("Dropout differ in train mode; checked in eval mode")
    # In train mode (as the contract test once built it) two seeded draws differ: not what dvla runs.
    policy = Small(SPEC, Small.Config(dropout=0.1)).train()
    again = [policy.act(_obs(), generator=torch.Generator().manual_seed(3)).actions for _ in range(2)]
    assert not torch.equal(*again)


def test_an_instance_is_checked_with_its_own_weights_and_the_bf16_gap_is_measured():
    policy = Small(SPEC, Small.Config())
    with torch.no_grad():
        policy.log_std.fill_(-1.5)
    report = assert_policy_contract(policy, **FAST)
    assert report.spec == SPEC and not policy.training
    gap = report["bf16"].measured
    assert 0 <= gap["per_dim"] <= BF16_TOLERANCE and gap["joint"] == pytest.approx(gap["per_dim"] * 4)
    assert f"(tolerance {BF16_TOLERANCE:g})" in report["bf16"].detail


def _obs():
    from dvla.contract import make_obs

    return make_obs(SPEC, 4)


PLUGIN = """
from dataclasses import dataclass

import torch
from torch import nn

from dvla import PolicyOutput, VLAPolicy, register_policy
from dvla.distributions import GaussianActionDistribution


@register_policy("my_vla")
class MyVLA(VLAPolicy):
    @dataclass(kw_only=True)
    class Config:
        width: int = 16

    def __init__(self, spec, config):
        super().__init__(spec, config)
        self.embed = nn.Embedding(1024, config.width)
        self.net = nn.Linear(spec.proprio_dim + config.width, spec.action_chunk * spec.action_dim)
        self.log_std = nn.Parameter(torch.zeros(spec.action_chunk, spec.action_dim))

    def forward(self, obs):
        x = torch.cat([obs.proprio, self.embed(obs.instruction_ids).mean(1)], dim=-1)
        mean = torch.tanh(self.net(x)).view(-1, *self.log_std.shape)
        if torch.is_grad_enabled():  # the broken rule: the learner sees another policy than the sampler
            mean = mean + 0.1
        return PolicyOutput(dist=GaussianActionDistribution(mean, self.log_std))
"""


def test_the_command_prints_a_line_per_check_and_exits_1_on_a_failure(tmp_path):
    plugin = tmp_path / "my_vla.py"
    plugin.write_text(PLUGIN)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "dvla.cli", "check-policy", "--import", str(plugin), *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    proc = run("policy.name=my_vla", "policy.options.width=8", "policy.action_chunk=2", "--entropy-samples=16")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("dvla check-policy: my_vla {'width': 8} on fast_reach's shapes") and \
        "actions 2 x 2" in lines[0]
    assert len(lines) == 2 + 18 and lines[-1] == "my_vla: 1 of 18 checks failed (evaluate), 4 skipped"
    failed = next(ln for ln in lines if ln.lstrip().startswith("FAIL"))
    assert failed.split()[1] == "evaluate" and "Fix: evaluate() must score the recorded actions" in failed
    assert sum(ln.lstrip().startswith("pass") for ln in lines) == 13
