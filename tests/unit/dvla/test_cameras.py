"""Named cameras: declared by the env spec, each at its own size, read by the policies that
ask for them, recorded, carried to the learner and checked there."""

from __future__ import annotations

import pytest
import torch

from dvla.algos.base import obs_of
from dvla.config import ConfigError, EnvConfig, apply_overrides
from dvla.envs import make_env
from dvla.policy import PolicySpec, build_policy
from dvla.config.presets import debug
from dvla.rollout import collect_episodes
from swimlane.lanes.validate import ChunkSpec, check_chunk

WRIST = EnvConfig(name="fast_reach", n_envs=4, image_size=16, options={"wrist_camera": 8})


def test_fast_reach_declares_and_renders_a_wrist_camera_of_its_own_size():
    env = make_env(WRIST)
    assert env.spec.cameras == (("wrist", (3, 8, 8)),)
    obs = env.reset(1)
    wrist = obs.cameras["wrist"]
    assert wrist.shape == (4, 3, 8, 8) and wrist.dtype == torch.uint8 and obs.image.shape == (4, 3, 16, 16)
    # The view is centred on the white effector: the brightest pixels are in the middle.
    white = wrist.float().min(dim=1).values  # (B, 8, 8): high only where all channels are
    assert bool((white[:, 3:5, 3:5].amax(dim=(1, 2)) >= white.amax(dim=(1, 2)) - 1).all())
    assert "wrist" in obs.images and obs.images["image"] is obs.image
    with pytest.raises(ConfigError, match=r"env.options.wrist_camera: must be an integer in \[0, 1024\], got -2"):
        make_env(EnvConfig(name="fast_reach", options={"wrist_camera": -2}))


def test_a_policy_reads_only_the_cameras_it_asks_for_and_they_are_recorded():
    pytest.importorskip("transformers")
    env = make_env(WRIST)
    spec = PolicySpec.for_env(env.spec)
    tiny = build_policy("tiny_vla", spec, {"hidden_dim": 8, "vision_channels": 4, "embed_dim": 4})
    assert tiny.cameras_used == () and tiny.prepare(env.reset(1)).cameras == {}
    assert collect_episodes(env, tiny, 3).cameras == {}  # nothing it does not read is stored

    vla = build_policy("token_vla", spec, {"n_bins": 16, "vision": {"image_size": 16}})
    assert vla.cameras_used == ("wrist",)
    batch = collect_episodes(env, vla, 3, generator=torch.Generator().manual_seed(0))
    assert batch.cameras["wrist"].shape == (batch.num_steps, 4, 3, 8, 8) and batch.image.dtype == torch.uint8
    # The learner's view of the recorded steps (cameras included) gives the rollout's log-probs.
    t, b = batch.valid.nonzero(as_tuple=True)
    data = {"image": batch.image[t, b], "proprio": batch.proprio[t, b], "ids": batch.instruction_ids[b],
            "ids_mask": batch.instruction_mask[b], "cameras.wrist": batch.cameras["wrist"][t, b]}
    out = vla.evaluate(obs_of(data), batch.actions[t, b], extras={k: v[t, b] for k, v in batch.extras.items()})
    assert torch.allclose(out.log_probs, batch.log_probs[t, b], atol=1e-4)
    # The wrist camera matters: another wrist image, another distribution over the same tokens.
    data["cameras.wrist"] = 255 - data["cameras.wrist"]
    other = vla.evaluate(obs_of(data), batch.actions[t, b], extras={k: v[t, b] for k, v in batch.extras.items()})
    assert not torch.allclose(other.log_probs, out.log_probs, atol=1e-4)
    # The learner checks the camera's size like every other field.
    chunk_spec = ChunkSpec.for_policy(vla, 4, 3)
    assert check_chunk(batch, chunk_spec, 0) is None
    batch.cameras["wrist"] = batch.cameras["wrist"][..., :4]
    assert check_chunk(batch, chunk_spec, 0)[0] == "shape"


def test_a_policy_asking_for_a_camera_the_env_lacks_is_a_config_error(tmp_path):
    pytest.importorskip("transformers")
    from swimlane import Swimlane

    cfg = apply_overrides(debug(), ["policy.name=token_vla", "policy.options={}", 'policy.options.cameras=["left"]',
                                    "env.options.wrist_camera=8", f"run.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"reads cameras \['left'\]; the env has \['wrist'\]"):
        Swimlane(cfg)


def test_prepare_keeps_the_cameras_a_policy_reads_in_its_order():
    env = make_env(WRIST)
    policy = build_policy("tiny_vla", PolicySpec.for_env(env.spec), {"hidden_dim": 8, "vision_channels": 4,
                                                                      "embed_dim": 4})
    obs = env.reset(1)
    obs.cameras = {"top": obs.cameras["wrist"][:, :, :4, :4], **obs.cameras}
    policy.cameras_used = ("wrist", "top")
    assert list(policy.prepare(obs).cameras) == ["wrist", "top"]
    policy.cameras_used = ("left",)
    with pytest.raises(ValueError, match=r"reads cameras \['left'\], which the observation lacks"):
        policy.prepare(obs)


def test_rollout_extras_the_data_plane_cannot_carry_are_a_config_error(tmp_path):
    """Checked when the job is built, not when the first chunk is sent."""
    from dvla.distributions import ExtraSpec
    from swimlane.assembly.build import check_policy_io

    env = make_env(WRIST)
    policy = build_policy("tiny_vla", PolicySpec.for_env(env.spec), {"hidden_dim": 8, "vision_channels": 4,
                                                                      "embed_dim": 4, "head": "flow"})
    check_policy_io(policy, "tiny_vla")  # the flow head's chain travels
    for extras, message in [({"z": ExtraSpec((2,), torch.complex64)}, r"dtype torch.complex64 cannot travel on the "
                                                                       r"data plane \(allowed: uint8, "),
                            ({"z": ExtraSpec((0, 2))}, r"shape \(0, 2\) must be positive integers"),
                            ({"z": (2,)}, r"expected an ExtraSpec\(shape, dtype, high\), got \(2,\)")]:
        policy.rollout_extras = lambda extras=extras: extras
        with pytest.raises(ConfigError, match=r"policy.name=tiny_vla: rollout_extras\(\)\['z'\]: " + message):
            check_policy_io(policy, "tiny_vla")
