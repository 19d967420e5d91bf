"""Contract test run over every registered policy, plus the extension rules."""

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from dvla.contract import assert_policy_contract
from dvla.distributions import GaussianActionDistribution
from dvla.policy import (
    POLICY_REGISTRY,
    HashTokenizer,
    PolicyOutput,
    PolicySpec,
    VLAPolicy,
    build_policy,
    register_policy,
)
from dvla.types import Observation
import dvla.models  # noqa: F401

SPEC = PolicySpec(image_shape=(3, 24, 24), proprio_dim=5, action_dim=3, action_chunk=2)
# Every registered policy, plus option sets that exercise its heads.
CASES = [(name, {}) for name in sorted(POLICY_REGISTRY)] + [
    ("tiny_vla", {"head": "gaussian", "value_head": False, "hidden_dim": 16}),
    ("tiny_vla", {"n_bins": 7, "hidden_dim": 16}),
    ("tiny_vla", {"head": "flow", "flow_steps": 3, "hidden_dim": 16}),
    ("token_vla", {"decoding": "parallel", "n_bins": 16, "value_head": True}),
    ("pi0_vla", {"version": "pi05", "vision": {"image_size": 16}, "pad_state_dim": 8, "pad_action_dim": 4}),
]


def make_obs(b=4, spec=SPEC):
    g = torch.Generator().manual_seed(1)
    return Observation(
        image=torch.randint(0, 256, (b, *spec.image_shape), dtype=torch.uint8, generator=g),
        proprio=torch.randn(b, spec.proprio_dim, generator=g),
        instruction=["pick up the red cube", "reach the blue target", "lift it", "pick up the red cube"][:b],
    )


@pytest.mark.parametrize("name, options", CASES)
def test_policy_contract(name, options):
    """The contract model authors run (``dvla check-policy``, :func:`dvla.contract.check_policy`),
    on every registered policy: one AssertionError lists what failed and what to do."""
    report = assert_policy_contract(name, SPEC, options)
    assert [r.name for r in report.results if r.status != "pass"] == []
    # Instruction ids were produced by the policy's tokenizer; batch of one works too.
    policy = build_policy(name, SPEC, options).eval()
    assert policy.act(make_obs(1)).actions.shape == (1, SPEC.action_chunk, SPEC.action_dim)


def test_language_changes_the_action_distribution():
    torch.manual_seed(0)
    policy = build_policy("tiny_vla", SPEC, {"hidden_dim": 16})
    for p in policy.parameters():  # make every path matter
        nn.init.normal_(p, std=0.3)
    obs = make_obs(2)
    a = policy.evaluate(obs, torch.zeros(2, 2, 3)).log_probs
    obs.instruction = ["something else entirely", "completely different words"]
    b = policy.evaluate(obs, torch.zeros(2, 2, 3)).log_probs
    assert not torch.allclose(a, b)


def test_tiny_vla_learn_wait_delays_only_the_forward_passes_that_learn(monkeypatch):
    """The waits are recorded, not timed: a bound of 50 ms on a pass without one failed on
    a loaded machine (0.15 s)."""
    import time

    import dvla.models.tiny_vla as tiny_vla
    from dvla.config import ConfigError

    policy = build_policy("tiny_vla", SPEC, {"hidden_dim": 16, "learn_wait_ms": 60.0})
    obs = make_obs(2)
    slept, real_sleep = [], time.sleep
    monkeypatch.setattr(tiny_vla.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    with torch.no_grad():  # acting and proximal log-probs: no wait
        policy.evaluate(obs, torch.zeros(2, 2, 3))
    assert slept == []
    t0 = time.perf_counter()
    policy.evaluate(obs, torch.zeros(2, 2, 3)).log_probs.sum().backward()
    assert slept == [pytest.approx(0.06)] and time.perf_counter() - t0 >= 0.06
    with pytest.raises(ConfigError, match="learn_wait_ms"):
        build_policy("tiny_vla", SPEC, {"learn_wait_ms": -1.0})


def test_tokenizer_is_deterministic():
    tok = HashTokenizer(vocab_size=100, max_len=4)
    ids = tok(["Pick up the RED cube!", "pick up the red cube", ""])
    assert ids.shape == (3, 4)
    assert torch.equal(ids[0], ids[1]) and ids[2].sum() == 0
    assert (ids[0] > 0).all() and (ids[0] < 100).all()


class _Minimal(VLAPolicy, abstract=True):
    """Intermediate base: allowed to leave Config/forward undefined."""


def test_incomplete_subclass_fails_at_definition():
    with pytest.raises(TypeError, match="must define `Config`"):

        class NoConfig(VLAPolicy):
            def forward(self, obs):
                raise NotImplementedError

    with pytest.raises(TypeError, match="must implement `forward"):

        class NoForward(VLAPolicy):
            @dataclass(kw_only=True)
            class Config:
                pass

    with pytest.raises(TypeError, match="accept `spec`"):

        class BadInit(VLAPolicy):
            @dataclass(kw_only=True)
            class Config:
                pass

            def __init__(self, size):
                pass

            def forward(self, obs):
                raise NotImplementedError


def test_custom_policy_registers_and_builds():
    @register_policy("test_linear")
    class Linear(VLAPolicy):
        @dataclass(kw_only=True)
        class Config:
            scale: float = 1.0

        def __init__(self, spec, config):
            super().__init__(spec, config)
            self.lin = nn.Linear(spec.proprio_dim, spec.action_chunk * spec.action_dim)
            self.log_std = nn.Parameter(torch.zeros(1, spec.action_chunk, spec.action_dim))

        def forward(self, obs):
            mean = self.lin(obs.proprio).view(-1, self.spec.action_chunk, self.spec.action_dim)
            return PolicyOutput(dist=GaussianActionDistribution(mean * self.config.scale, self.log_std))

    try:
        policy = build_policy("test_linear", SPEC, {"scale": 0.5})
        assert policy.config.scale == 0.5
        assert policy.act(make_obs()).actions.shape == (4, 2, 3)
        with pytest.raises(ValueError, match="already registered"):
            register_policy("test_linear")(type("Other", (Linear,), {}))
    finally:
        POLICY_REGISTRY.pop("test_linear", None)


def test_a_submodule_named_like_the_api_fails_at_construction():
    from dataclasses import dataclass

    from torch import nn

    from dvla.policy import PolicyOutput, PolicySpec, VLAPolicy

    class Shadowing(VLAPolicy):
        @dataclass(kw_only=True)
        class Config:
            pass

        def __init__(self, spec, config):
            super().__init__(spec, config)
            self.act = nn.Linear(2, 2)  # what LeRobot's ACT-style code does

        def forward(self, obs) -> PolicyOutput:
            raise NotImplementedError

    with pytest.raises(TypeError, match=r"Shadowing: `self.act = <module>` would hide VLAPolicy.act; name the "
                                        r"submodule otherwise \(e.g. `self.act_head`\)"):
        Shadowing(PolicySpec((3, 8, 8), 2, 2), Shadowing.Config())


def test_the_bootstrap_value_runs_no_forward_pass_when_estimate_value_gives_it():
    from dvla.models.tiny_vla import TinyVLA

    class Critic(TinyVLA):
        def __init__(self, spec, config):
            super().__init__(spec, config)
            self.has_value_head, self.forwards = True, 0
            self.critic = nn.Linear(spec.proprio_dim, 1)

        def forward(self, obs):
            self.forwards += 1
            return super().forward(obs)

        def estimate_value(self, obs):
            return self.critic(obs.proprio).squeeze(-1)

    policy, obs = Critic(SPEC, TinyVLA.Config(hidden_dim=16, value_head=False)), make_obs()
    value = policy.value(obs)
    assert policy.forwards == 0 and torch.equal(value, policy.critic(obs.proprio).squeeze(-1).detach())
    assert torch.equal(policy.act(obs).values, value) and policy.forwards == 1  # the rollout's values: the same
    plain, calls = build_policy("tiny_vla", SPEC, {"hidden_dim": 16}), []
    plain.register_forward_hook(lambda *_: calls.append(1))
    assert plain.value(obs).shape == (4,) and calls == [1]  # a value from forward: one pass


def test_a_value_head_may_be_a_separate_module(tmp_path):
    """PPO with a critic that is its own module (``estimate_value``), not an output of
    ``forward``: the rollouts record its values and the learner trains it."""
    from torch import nn

    from dvla.config import apply_overrides
    from dvla.metrics import read_metrics
    from dvla.models.tiny_vla import TinyVLA
    from dvla.policy import POLICY_REGISTRY, register_policy
    from dvla.config.presets import debug
    from swimlane import Swimlane

    if "separate_critic_vla" not in POLICY_REGISTRY:
        @register_policy("separate_critic_vla")
        class SeparateCritic(TinyVLA):
            has_value_head = True

            def __init__(self, spec, config):
                super().__init__(spec, config)
                self.has_value_head = True  # TinyVLA sets it from its own option
                self.value_net = nn.Sequential(nn.Linear(spec.proprio_dim, 16), nn.Tanh(), nn.Linear(16, 1))

            def forward(self, obs):
                out = super().forward(obs)
                out.value = None  # the value comes from the separate module
                return out

            def estimate_value(self, obs):
                return self.value_net(obs.proprio).squeeze(-1)

    lanes = Swimlane(apply_overrides(debug(), ["policy.name=separate_critic_vla", "policy.options.value_head=false",
                                              "algo.name=ppo", "run.iterations=3", "swimlane.mode=sync",
                                              "swimlane.driver=serial", f"run.out_dir={tmp_path}"]))
    before = [p.detach().clone() for p in lanes.policy.value_net.parameters()]
    summary = lanes.run()
    assert summary["version"] == 3
    assert any(not torch.equal(b, p) for b, p in zip(before, lanes.policy.value_net.parameters()))
    assert all(r["value_loss"] > 0 for r in read_metrics(tmp_path / "metrics.jsonl"))
