"""``dvla export``'s pi0 layouts: a trained pi0_vla written back under the names LeRobot's
``save_pretrained`` wrote (the fixture tests/fixtures/pi0), loaded again to the same tensors,
LoRA merged; and the one-line errors. (Whether LeRobot's own code loads an export and acts the
same is bench/pi0_reference.py's --check-export, in the reference's venv.)"""

from __future__ import annotations

import json

import pytest
import torch

from dvla.policy import build_policy
from tests.unit.dvla.test_pi0_reference import FIXTURE, FIXTURES, VERSIONS, _options

pytest.importorskip("transformers")


def _trained(version: str = "pi0", **more):
    """The fixture's policy with every parameter moved, as RL would."""
    from dvla.policy import PolicySpec

    spec = PolicySpec((3, 48, 64), 8, 7, 10, cameras=(("left_wrist_0_rgb", (3, 48, 64)),))
    policy = build_policy("pi0_vla", spec, _options(version, **more))
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in policy.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return policy


@pytest.mark.parametrize("version", list(VERSIONS))
def test_a_lerobot_export_has_lerobots_keys_and_loads_back_to_the_same_tensors(tmp_path, version):
    from safetensors import safe_open

    from dvla.models.pi0_export import export_pi0

    policy, source = _trained(version), FIXTURES / version
    written = export_pi0(policy, tmp_path / "out", "lerobot", source, policy.normalizer)
    assert {"model.safetensors", "config.json", "policy_preprocessor.json", "policy_postprocessor.json",
            "tokenizer/"} <= set(written)
    shapes = lambda f: {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: E731
    with safe_open(str(source / "model.safetensors"), "pt") as theirs, \
            safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as ours:
        assert shapes(ours) == shapes(theirs)  # LeRobot's names and shapes, key for key
    again = build_policy("pi0_vla", policy.spec, _options(version, pretrained_path=str(tmp_path / "out")))
    for name, value in policy.state_dict().items():
        if name != "action_head.log_sigma":  # dvla's own: pi0 has no chain noise
            assert torch.equal(again.state_dict()[name], value), name
    assert again.normalizer.digest() == policy.normalizer.digest()


def test_lora_adapters_are_merged_into_the_exported_weights(tmp_path):
    from dvla.models.pi0_export import export_pi0

    policy = _trained(lora_rank=4, lora_expert=True)
    assert any("lora_B" in n for n, _ in policy.named_parameters())
    export_pi0(policy, tmp_path / "out", "openpi", None, policy.normalizer)
    assert json.loads((tmp_path / "out" / "assets" / "dvla" / "norm_stats.json").read_text())["norm_stats"].keys() \
        == {"state", "actions"}
    # (openpi pads its images with -1.0 where LeRobot's -3.0: the same preprocessing asked for here)
    again = build_policy("pi0_vla", policy.spec, _options(pretrained_path=str(tmp_path / "out"), image_pad_value=-3.0))
    cache = policy.encode_prefix(policy.model_inputs(_obs(policy)))[0]
    cache2 = again.encode_prefix(again.model_inputs(_obs(policy)))[0]
    x, t = torch.randn(2, 10, 32), torch.tensor([0.3, 0.8])
    with torch.no_grad():
        assert torch.allclose(again.expert(x, t, cache2), policy.expert(x, t, cache), atol=1e-5)
    # openpi's z-scores give back the run's statistics.
    assert torch.allclose(again.normalizer.proprio_mean, policy.normalizer.proprio_mean)
    assert torch.allclose(again.normalizer.proprio_std, policy.normalizer.proprio_std, rtol=1e-6)


def _obs(policy):
    from dvla.types import Observation

    g = torch.Generator().manual_seed(1)
    frames = lambda: torch.randint(0, 256, (2, 3, 48, 64), generator=g, dtype=torch.uint8)  # noqa: E731
    return Observation(image=frames(), proprio=torch.randn(2, 8, generator=g), instruction=["pick it", "open it"],
                       cameras={"left_wrist_0_rgb": frames()})


def test_a_lerobot_export_needs_its_source_and_its_statistics(tmp_path):
    from dvla.models.pi0_export import ExportError, export_pi0
    from dvla.normalize import Normalizer

    policy = _trained()
    with pytest.raises(ExportError, match="config.json of the checkpoint the run started from"):
        export_pi0(policy, tmp_path / "a", "lerobot", None, policy.normalizer)
    other = Normalizer(proprio_mean=torch.zeros(8), proprio_std=torch.ones(8))
    with pytest.raises(ExportError, match="another normalisation"):
        export_pi0(policy, tmp_path / "b", "lerobot", FIXTURE, other)
    with pytest.raises(ExportError, match="one of lerobot, openpi"):
        export_pi0(policy, tmp_path / "c", "onnx", FIXTURE, policy.normalizer)
