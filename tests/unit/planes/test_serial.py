"""Data-plane wire format: bit-exact round trips, zero-copy frames, strict rejection."""

import msgpack
import pytest
import torch

from planes.serial import PACK_ALIGN, PACK_LIMIT, PROTOCOL_VERSION, MessageError, decode, decode_head, encode
from dvla.envs import make_env
from dvla.config import EnvConfig
from dvla.policy import PolicySpec, build_policy
from dvla.rollout import collect_episodes
from dvla.types import RolloutBatch


def test_round_trip_bit_exact_all_dtypes(every_dtype_tensors):
    tensors = every_dtype_tensors
    frames = encode("test", tensors, {"seq": 7, "rank": 1})
    kind, meta, got = decode([bytes(f) for f in frames])
    assert kind == "test" and meta == {"seq": 7, "rank": 1}
    assert list(got) == list(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape
        # Compare the raw bytes: bit-exact, NaN payloads and signed zeros included.
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), k


def test_large_tensors_are_zero_copy_frames_small_ones_share_the_packed_frame():
    big = torch.arange(PACK_LIMIT // 4, dtype=torch.float32)  # PACK_LIMIT bytes: a frame of its own
    a, b = torch.arange(3), torch.ones(5, dtype=torch.bool)
    frames = encode("x", {"a": a, "big": big, "empty": torch.zeros(0), "b": b})
    assert len(frames) == 3  # envelope, packed (a, empty, b), big
    big[0] = 42.0  # the large frame is the tensor's own memory
    assert torch.frombuffer(bytearray(frames[2]), dtype=torch.float32)[0] == 42.0
    a[0] = 7  # the packed frame is a copy
    packed = bytes(frames[1])  # a at 0, b at the next PACK_ALIGN boundary, nothing after b
    assert packed == torch.arange(3).numpy().tobytes() + bytes(PACK_ALIGN - 24) + bytes([1] * 5)
    _, _, got = decode([bytes(f) for f in frames])
    assert torch.equal(got["a"], torch.arange(3)) and torch.equal(got["b"], b) and got["empty"].shape == (0,)
    assert torch.equal(got["big"], big)


def test_rollout_batch_round_trip():
    cfg = EnvConfig(name="fast_reach", n_envs=4, image_size=16)
    env = make_env(cfg)
    spec = PolicySpec.for_env(env.spec)
    policy = build_policy("tiny_vla", spec, {"hidden_dim": 8, "vision_channels": 4, "embed_dim": 4})
    batch = collect_episodes(env, policy, 5, group_size=2, policy_version=3)
    _, meta, got = decode(encode("rollout", batch.to_dict(), {"version": 3}))
    back = RolloutBatch.from_dict(got)
    for k, v in batch.to_dict().items():
        assert torch.equal(getattr(back, k), v), k


def envelope(**over):
    env = {"v": PROTOCOL_VERSION, "kind": "k", "meta": {}, "tensors": [["a", "float32", [2], 8]]}
    env.update(over)
    return msgpack.packb(env, use_bin_type=True)


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([], "bad_envelope"),
        ([b"\xc1garbage"], "bad_envelope"),
        ([msgpack.packb([1, 2, 3])], "bad_envelope"),
        ([envelope(v=1), b"\x00" * 8], "bad_version"),  # one frame per tensor: no longer spoken
        ([envelope(v=3), b"\x00" * 8], "bad_version"),
        ([envelope(), b"\x00" * 7], "bad_tensor"),  # truncated data frame
        ([envelope()], "bad_frames"),  # missing data frame
        ([envelope(), b"\x00" * 8, b"x"], "bad_frames"),  # extra frame
        ([envelope(tensors=[["a", "object", [2], 8]]), b"\x00" * 8], "bad_tensor"),
        ([envelope(tensors=[["a", ["float32"], [2], 8]]), b"\x00" * 8], "bad_tensor"),  # unhashable dtype
        ([envelope(tensors=[["a", "float32", [True, 2], 8]]), b"\x00" * 8], "bad_tensor"),
        ([envelope(tensors=[["a", "float32", [-2], 8]]), b"\x00" * 8], "bad_tensor"),
        ([envelope(tensors=[["a", "float32", [3], 8]]), b"\x00" * 8], "bad_tensor"),
        ([envelope(tensors=[["a", "float32", [2]]]), b"\x00" * 8], "bad_tensor"),
        ([envelope(tensors=[["a", "uint8", [2], 2], ["a", "uint8", [2], 2]]), b"ab", b"cd"], "bad_tensor"),
        ([envelope(meta=msgpack.ExtType(1, b"x")), b"\x00" * 8], "bad_envelope"),
        ([envelope(extra=1), b"\x00" * 8], "bad_envelope"),
    ],
)
def test_malformed_messages_are_rejected(frames, reason):
    with pytest.raises(MessageError) as info:
        decode(frames)
    assert info.value.reason == reason


def test_oversized_message_rejected():
    frames = encode("big", {"a": torch.zeros(1000, dtype=torch.uint8)})
    with pytest.raises(MessageError, match="oversized"):
        decode(frames, max_bytes=999)


def test_encode_refuses_what_it_cannot_send():
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        encode("x", {"a": [1, 2]})
    with pytest.raises(ValueError, match="unsupported dtype"):
        encode("x", {"a": torch.zeros(2, dtype=torch.complex64)})


def test_validated_tensor_lists_are_reused_but_never_across_types():
    """The receiver keeps the validation of a tensor list it has seen (a sender repeats it
    message after message); the key is the list's exact bytes, so a shape of ``[True, 2]``
    is not taken for a known ``[1, 2]``, and a rejected list is rejected every time."""
    good = [envelope(tensors=[["a", "float32", [1, 2], 8]]), b"\x00" * 8]
    _, _, first = decode(good)
    _, _, again = decode(good)
    assert torch.equal(first["a"], again["a"]) and first["a"].shape == (1, 2)
    assert decode_head(good[0])[2] is decode_head(good[0])[2]  # the same validated layout
    for _ in range(2):
        with pytest.raises(MessageError) as info:
            decode([envelope(tensors=[["a", "float32", [True, 2], 8]]), b"\x00" * 8])
        assert info.value.reason == "bad_tensor" and "bad shape" in str(info.value)
    with pytest.raises(MessageError, match="oversized"):  # the limit is checked per call, cached or not
        decode(good, max_bytes=7)


def test_the_encoder_reuses_its_plan_but_the_bytes_are_what_msgpack_makes():
    """The sender keeps the envelope bytes and packed layout of a tensor list (same names,
    dtypes and shapes); the envelope is still exactly ``msgpack.packb`` of the map, and a
    change of shape or dtype makes a new plan."""
    for shape, dtype in [((2, 3), torch.float32), ((2, 3), torch.float32), ((3, 2), torch.float32),
                         ((2, 3), torch.int16)]:
        x = torch.arange(6).reshape(shape).to(dtype)
        meta = {"seq": 4, "nested": {"a": [1, 2.5, None]}}
        frames = encode("roll", {"x": x, "big": torch.zeros(PACK_LIMIT, dtype=torch.uint8)}, meta)
        specs = [["x", str(dtype).removeprefix("torch."), list(shape), 6 * x.element_size()],
                 ["big", "uint8", [PACK_LIMIT], PACK_LIMIT]]
        assert frames[0] == msgpack.packb({"v": PROTOCOL_VERSION, "kind": "roll", "meta": meta, "tensors": specs},
                                          use_bin_type=True)
        _, got_meta, got = decode([bytes(f) for f in frames])
        assert got_meta == meta and torch.equal(got["x"], x) and got["x"].dtype == dtype
