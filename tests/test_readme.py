"""The model example in docs/adding-a-model.md runs as written, and the README's two commands
are present and match CI's."""

import re

import torch

from dvla.policy import POLICY_REGISTRY, PolicySpec, build_policy
from dvla.types import Observation
from tests.helpers import ROOT

README = ROOT / "README.md"
MODEL_PAGE = ROOT / "docs" / "adding-a-model.md"


def test_readme_policy_example_works():
    blocks = re.findall(r"```python\n(.*?)```", MODEL_PAGE.read_text(), re.S)
    example = next(b for b in blocks if "register_policy" in b)
    try:
        exec(compile(example, "docs/adding-a-model.md", "exec"), {})
        spec = PolicySpec(image_shape=(3, 8, 8), proprio_dim=3, action_dim=2, action_chunk=2)
        policy = build_policy("my_vla", spec, {"width": 16})
        obs = Observation(image=torch.zeros(5, 3, 8, 8, dtype=torch.uint8), proprio=torch.randn(5, 3),
                          instruction=["go"] * 5)
        out = policy.act(obs)
        assert out.actions.shape == (5, 2, 2)
        torch.testing.assert_close(policy.evaluate(obs, out.actions).log_probs, out.log_probs)
    finally:
        POLICY_REGISTRY.pop("my_vla", None)


def test_readme_commands_match_ci():
    text = README.read_text()
    assert 'pip install "torch==2.13.0" -e ".[dev,vla]" && python -m dvla.launch' in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in text and "python -m pytest -q" in ci
    assert "torch==2.13.0" in ci, "CI installs the torch wheel the README pins"
