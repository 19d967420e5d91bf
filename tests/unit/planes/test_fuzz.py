"""Fuzzing the data plane: no malformed input may crash the decoder or the receiver.

Two levels:

* ``planes.serial`` alone, with hypothesis (deterministic: ``derandomize=True``): random
  bytes, byte-level mutations of valid envelopes and msgpack-valid envelopes whose fields
  break the schema. Every input either decodes into something the schema allows (checked
  here independently of the decoder) or raises ``MessageError`` with a known reason.
* a real ``TrajectoryReceiver`` fed over a raw ZeroMQ PUSH socket on ``ipc://`` with a
  seeded stream of thousands of malformed multipart messages interleaved with valid
  ones. Each message's fate (delivered, rejected for which reason, or a heartbeat) is
  predicted here from the wire format, and the receiver must match that exactly.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import threading
import time
import tracemalloc

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planes.data import (
    HEARTBEAT_KIND,
    DataPlaneConfig,
    TrajectoryReceiver,
    TrajectorySender,
)
from planes.serial import (
    DTYPES,
    PROTOCOL_VERSION,
    MessageError,
    TensorSpec,
    as_tensor,
    decode,
    decode_envelope,
    encode,
    layout,
)

REASONS = {"bad_envelope", "bad_version", "bad_tensor", "bad_frames", "oversized"}
DTYPE_NAMES = sorted(DTYPES)
ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}
ENVELOPE_KEYS = ("v", "kind", "meta", "tensors")
MAX_ENVELOPE = 1 << 20  # the wire format's limit on frame 0
MAX_BYTES = 1 << 16  # decode-level fuzz: small enough to materialise every accepted tensor
MUTANTS = 8  # inputs derived from each hypothesis example

FUZZ = settings(
    max_examples=3000,
    deadline=None,
    derandomize=True,  # the same examples on every run
    database=None,  # and no .hypothesis/ directory left behind
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
# Structured examples cost hypothesis ~10 ms each to generate on a small machine: fewer of
# them, each checked together with MUTANTS seeded variants.
HEAVY = settings(FUZZ, max_examples=1000)

INTERESTING_INTS = [0, 1, -1, 2, 3, 8, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**39, 2**40 - 1, 2**40,
                    2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -(2**31), -(2**63)]
# msgpack type bytes worth planting: nil, never-used, bool, bin/ext/float/int/str/array/map
# headers of every width, and the edges of the fix-types.
MARKERS = [0x00, 0x7F, 0x80, 0x84, 0x8F, 0x90, 0x94, 0x9F, 0xA0, 0xBF, 0xE0, 0xFF] + list(range(0xC0, 0xE0))
# Headers that announce far more than any envelope holds, and extension payloads.
HUGE_HEADERS = [
    b"\xdc\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xde\xff\xff", b"\xdf\xff\xff\xff\xff",  # array/map 16/32
    b"\xc4\xff", b"\xc5\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",  # bin 8/16/32, str 32
    b"\xc9\xff\xff\xff\xff\x01", b"\xd4\x01\x00", b"\xd4\xff\x00",  # ext 32, fixext 1, bad timestamp
    b"\xd6\xff\x00\x00\x00\x01", b"\xc7\x0c\xff" + bytes(12),  # valid timestamps (ext -1)
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",  # uint64 max, int64 min
]


# -- an independent statement of the schema ----------------------------------------------

def is_plain(obj) -> bool:
    """Only what msgpack's core types decode to: no extension objects anywhere."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if not all(type(k) in (str, bytes) for k in x):
                return False
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif type(x) not in (type(None), bool, int, float, str, bytes):
            return False
    return True


def check_envelope(buf, max_bytes: int = MAX_BYTES):
    """Decode frame 0; return the rejection reason, or None after checking that what was
    accepted is exactly what the wire format allows."""
    try:
        kind, meta, specs = decode_envelope(buf, max_bytes)
    except MessageError as exc:
        assert exc.reason in REASONS, exc.reason
        assert str(exc).startswith(exc.reason + ": ") and len(str(exc)) < 1000, str(exc)[:2000]
        return exc.reason
    assert len(buf) <= MAX_ENVELOPE
    env = msgpack.unpackb(buf, raw=False, strict_map_key=True)
    assert type(env) is dict and sorted(env) == sorted(ENVELOPE_KEYS)
    assert type(env["v"]) is int and env["v"] == PROTOCOL_VERSION
    assert type(kind) is str and kind == env["kind"]
    assert type(meta) is dict and is_plain(meta)
    assert msgpack.packb(meta) == msgpack.packb(env["meta"])  # byte comparison: NaN-safe
    assert type(env["tensors"]) is list and len(specs) == len(env["tensors"])
    for spec, raw in zip(specs, env["tensors"]):
        assert isinstance(spec, TensorSpec) and type(raw) is list and len(raw) == 4
        name, dtype, shape, nbytes = raw
        assert type(name) is str and name and spec.name == name
        assert type(dtype) is str and spec.dtype == DTYPES[dtype]
        assert type(shape) is list and len(shape) <= 8 and all(type(d) is int and d >= 0 for d in shape)
        assert spec.shape == shape and type(nbytes) is int and spec.nbytes == nbytes
        assert nbytes == math.prod(shape) * ITEMSIZE[dtype]
        t = as_tensor(bytearray(nbytes), spec)  # whatever is accepted can be built
        assert t.dtype == spec.dtype and list(t.shape) == shape
    assert len({s.name for s in specs}) == len(specs)
    assert sum(s.nbytes for s in specs) <= max_bytes
    return None


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).numpy())


# -- hypothesis strategies ----------------------------------------------------------------

ints = st.one_of(st.integers(-3, 70), st.sampled_from(INTERESTING_INTS), st.integers(-(2**63), 2**64 - 1))
texts = st.one_of(st.sampled_from(["", "a", "k", "rollout", "sender", "seq", "\x00", "é", "💥"]),
                  st.text(st.characters(max_codepoint=0x2FFF, exclude_categories=["Cs"]), max_size=8))
plain_scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), texts, st.binary(max_size=10))
scalars = st.one_of(
    plain_scalars,
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=6)),
    st.builds(msgpack.Timestamp, st.integers(0, 2**34 - 1), st.integers(0, 999_999_999)),
)
keys = st.one_of(texts, st.binary(max_size=6), st.sampled_from(ENVELOPE_KEYS), st.sampled_from([b"v", b"kind"]),
                 ints, st.none(), st.booleans())
garbage = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(keys, inner, max_size=4)), max_leaves=8)
plain_meta = st.dictionaries(texts, st.recursive(plain_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)), max_leaves=5), max_size=3)
dims = st.one_of(st.integers(0, 6), st.sampled_from(INTERESTING_INTS))
weird_dims = st.one_of(dims, st.booleans(), st.floats(0, 8), texts, st.none(), garbage)
names = st.one_of(st.sampled_from(["a", "b", "obs"]), texts)  # a small pool: duplicates are common
bad_dtypes = st.one_of(st.sampled_from(["object", "float", "complex64", "uint16", "Float32", "float32 ", "",
                                        "torch.float32", "qint8", "bool_"]), st.binary(max_size=8), garbage)
versions = st.one_of(st.sampled_from([0, 1, 3, -1, 255, 2**64 - 1, True, 2.0, "2", b"\x02", [2], {"v": 2}, None]),
                     garbage)


@st.composite
def tensor_specs(draw):
    """A spec that is valid, or valid but for one or two broken parts."""
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    shape = draw(st.lists(st.integers(0, 5), max_size=4))
    spec = [draw(names), dtype, shape, math.prod(shape) * ITEMSIZE[dtype]]
    for _ in range(draw(st.integers(0, 2))):
        what = draw(st.integers(0, 8))
        if what == 0:
            spec[0] = draw(st.one_of(st.just(""), garbage))
        elif what == 1:
            spec[1] = draw(bad_dtypes)
        elif what == 2:  # huge, negative or non-int dims, with the byte count they would need
            shape = draw(st.lists(weird_dims, max_size=10))
            spec[2] = shape
            if all(type(d) is int for d in shape) and isinstance(spec[1], str) and spec[1] in DTYPES:
                need = math.prod(shape) * ITEMSIZE[spec[1]]
                spec[3] = need if -(2**63) <= need < 2**64 else draw(ints)
        elif what == 3:  # large dims, but one of them zero: an empty tensor
            shape = draw(st.lists(dims, min_size=1, max_size=8))
            shape[draw(st.integers(0, len(shape) - 1))] = 0
            spec[2], spec[3] = shape, 0
        elif what == 4:
            near = [n for n in (spec[3] - 1, spec[3] + 1) if -(2**63) <= n < 2**64] if type(spec[3]) is int else []
            spec[3] = draw(st.one_of(ints, garbage, *([st.sampled_from(near)] if near else [])))
        elif what == 5:  # the remaining cases change the spec's length: last
            del spec[draw(st.integers(0, 3))]
            return spec
        elif what == 6:
            return spec + [draw(garbage)]
        elif what == 7:
            return draw(garbage)
        else:
            spec[2] = draw(garbage)
    return spec


@st.composite
def envelope_maps(draw):
    """An envelope map that is valid, or valid but for a few broken fields."""
    env = {"v": PROTOCOL_VERSION, "kind": draw(texts), "meta": draw(plain_meta),
           "tensors": draw(st.lists(tensor_specs(), max_size=3))}
    for _ in range(draw(st.integers(0, 3))):
        what = draw(st.integers(0, 5))
        key = draw(st.sampled_from(ENVELOPE_KEYS))
        if what == 0:
            env[key] = draw(garbage)
        elif what == 1:
            env.pop(key, None)
        elif what == 2:
            env[draw(keys)] = draw(garbage)
        elif what == 3:
            env["v"] = draw(versions)
        elif what == 4:
            env["meta"] = draw(st.dictionaries(keys, garbage, max_size=4))
        else:
            env["tensors"] = draw(st.lists(tensor_specs(), min_size=1, max_size=6))
    return env


def deep(depth: int, kind: int) -> bytes:
    """``depth`` nested single-element containers around a nil, as raw msgpack."""
    return (b"\x91", b"\x81\xa1k", b"\xdc\x00\x01")[kind] * depth + b"\xc0"


@st.composite
def envelope_bytes(draw):
    """Pack an envelope map, each value separately so that one can be replaced by a raw
    deeply nested structure (msgpack's packer refuses to build those)."""
    env = draw(envelope_maps())
    items = [(msgpack.packb(k, use_bin_type=True), msgpack.packb(v, use_bin_type=draw(st.booleans())))
             for k, v in env.items()]
    if items and draw(st.booleans()):
        depth = draw(st.one_of(st.integers(0, 1200), st.integers(990, 1030)))
        where = draw(st.integers(0, len(items) - 1))
        nested = deep(depth, draw(st.integers(0, 2)))
        if draw(st.booleans()):  # as the only tensor spec, or inside one
            nested = b"\x91" + (b"\x94\xa1a\xa7float32" + nested + b"\x00" if draw(st.booleans()) else nested)
        items[where] = (items[where][0], nested)
    head = bytes([0x80 | len(items)]) if len(items) < 16 else b"\xde" + len(items).to_bytes(2, "big")
    return head + b"".join(k + v for k, v in items)


@st.composite
def valid_messages(draw):
    """Frames of a valid message: small random tensors of every dtype, random contents."""
    tensors = {}
    for _ in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(DTYPE_NAMES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        data = bytearray(draw(st.binary(min_size=nbytes, max_size=nbytes)))
        if dtype == "bool":
            data = bytearray(b & 1 for b in data)
        t = torch.frombuffer(data, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        tensors[draw(st.text(min_size=1, max_size=6))] = t.view(DTYPES[dtype]).reshape(shape)
    return [bytes(f) for f in encode(draw(texts), tensors, draw(plain_meta))]


def mutate_bytes(rng: random.Random, buf: bytes) -> bytes:
    """One to four of: bit flip, planted type byte, truncation, insertion of random bytes or
    of a huge-length header, deletion, duplication of a slice."""
    buf = bytearray(buf)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(buf) + 1)
        what = rng.randrange(7)
        if what == 0 and buf:
            buf[min(i, len(buf) - 1)] ^= 1 << rng.randrange(8)
        elif what == 1 and buf:
            buf[min(i, len(buf) - 1)] = rng.choice(MARKERS)
        elif what == 2:
            del buf[i:]
        elif what == 3:
            buf[i:i] = rng.randbytes(rng.randint(1, 8))
        elif what == 4:
            buf[i:i] = rng.choice(HUGE_HEADERS)
        elif what == 5:
            del buf[i:i + rng.randint(1, 8)]
        else:
            j = rng.randrange(len(buf) + 1)
            buf[i:i] = buf[min(i, j):max(i, j)]
    return bytes(buf)


def mutate_frames(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """Zero to three of: a frame dropped, inserted, one byte short or long, emptied, two
    frames swapped, the envelope mutated."""
    frames = list(frames)
    for _ in range(rng.randrange(4)):
        what = rng.randrange(6)
        i = rng.randrange(len(frames) + 1)
        data = min(max(i, 1), len(frames) - 1)  # a data frame, if there is one
        if what == 0 and frames:
            del frames[min(i, len(frames) - 1)]
        elif what == 1:
            frames.insert(i, rng.randbytes(rng.randrange(40)))
        elif what == 2 and data >= 1:
            frames[data] = frames[data][:-1] if rng.random() < 0.5 else frames[data] + b"\x00"
        elif what == 3 and data >= 1:
            frames[data] = b""
        elif what == 4 and len(frames) > 2:
            frames[1], frames[-1] = frames[-1], frames[1]
        elif what == 5 and frames:
            frames[0] = mutate_bytes(rng, frames[0])
    return frames


# -- decode-level fuzz ----------------------------------------------------------------------

seeds = st.integers(0, 2**32 - 1)


@FUZZ
@given(st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=64).map(lambda b: b"\x84" + b),  # past the first byte: a 4-entry map
    st.lists(st.one_of(st.sampled_from(MARKERS).map(lambda m: bytes([m])), st.sampled_from(HUGE_HEADERS),
                       st.binary(max_size=3)), max_size=40).map(b"".join),  # msgpack-shaped noise
))
def test_random_bytes_never_crash_the_decoder(buf):
    check_envelope(buf)


@HEAVY
@given(envelope_maps(), st.booleans(), seeds)
def test_schema_invalid_envelopes_are_rejected_with_a_reason(env, bin_type, seed):
    check_envelope(msgpack.packb(env, use_bin_type=bin_type))
    fuzz = WireFuzzer(seed)  # and a few more broken fields on top
    for _ in range(MUTANTS // 2):
        check_envelope(msgpack.packb(fuzz.broken_env(env), use_bin_type=bin_type))


@pytest.mark.parametrize("key", ENVELOPE_KEYS)
def test_deep_nesting_anywhere_decodes_or_is_rejected(key):
    """Values nested up to and past msgpack's own limit (about 1024 containers), as any
    field, as a tensor spec or inside one. (Deep maps are a valid meta.)"""
    for depth in [*range(0, 1100, 11), *range(985, 1030)]:
        for kind in range(3):
            nested = deep(depth, kind)
            for raw in (nested, b"\x91" + nested, b"\x91\x94\xa1a\xa7float32" + nested + b"\x00"):
                check_envelope(_raw_env(raw, key))


@HEAVY
@given(st.one_of(valid_messages().map(lambda frames: frames[0]), envelope_bytes()), seeds)
def test_mutated_envelopes_never_crash_the_decoder(base, seed):
    rng = random.Random(seed)  # several mutants per example: generating the base is the slow part
    for _ in range(MUTANTS):
        check_envelope(mutate_bytes(rng, base))


@HEAVY
@given(valid_messages(), seeds)
@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_whole_messages_decode_or_are_rejected(frames, seed):
    """Envelope and data frames together: frames dropped, added, resized, emptied or
    swapped, envelopes mutated or with a broken field. What decodes holds exactly the bytes
    of its frames."""
    fuzz = WireFuzzer(seed)
    for i in range(MUTANTS):
        mutant = frames
        if i % 4 == 3:
            mutant = [msgpack.packb(fuzz.broken_env(msgpack.unpackb(frames[0])), use_bin_type=True)] + frames[1:]
        check_message(mutate_frames(fuzz.rng, mutant))


def check_message(frames: list[bytes]) -> None:
    """``decode`` either raises MessageError or returns tensors whose bytes are the frames'."""
    try:
        kind, meta, tensors = decode(frames, MAX_BYTES)
    except MessageError as exc:
        assert exc.reason in REASONS
        return
    assert check_envelope(frames[0]) is None
    env_kind, env_meta, specs = decode_envelope(frames[0], MAX_BYTES)
    assert kind == env_kind and msgpack.packb(meta) == msgpack.packb(env_meta)
    sizes = frame_sizes(specs)
    assert [len(f) for f in frames[1:]] == sizes and list(tensors) == [s.name for s in specs]
    for spec, want in zip(specs, tensor_bytes(specs, frames[1:])):
        t = tensors[spec.name]
        assert t.dtype == spec.dtype and list(t.shape) == spec.shape and raw_bytes(t) == want


def frame_sizes(specs: list[TensorSpec]) -> list[int]:
    """The data frames' sizes the wire format demands, in order: the packed frame of the
    small tensors (if any), then one per large tensor."""
    packed, offsets = layout(specs)
    return ([] if packed is None else [packed]) + [s.nbytes for s, off in zip(specs, offsets) if off is None]


def tensor_bytes(specs: list[TensorSpec], data: list[bytes]) -> list[bytes]:
    """Each tensor's bytes, cut from data frames of the right sizes."""
    packed, offsets = layout(specs)
    large = iter(data[packed is not None:])
    return [next(large) if off is None else data[0][off:off + s.nbytes] for s, off in zip(specs, offsets)]


# -- regressions: inputs the fuzz found that used to escape as other exceptions -----------

def _env(**fields) -> dict:
    env = {"v": PROTOCOL_VERSION, "kind": "k", "meta": {}, "tensors": []}
    env.update(fields)
    return env


def _raw_env(raw_value: bytes, key: str) -> bytes:
    """The valid empty envelope with the value of ``key`` replaced by raw msgpack."""
    items = [msgpack.packb(k) + (raw_value if k == key else msgpack.packb(v)) for k, v in _env().items()]
    return b"\x84" + b"".join(items)


REGRESSIONS = {
    # sorting the keys of a map that mixes str and bytes keys raised TypeError
    "mixed_key_types": (msgpack.packb({b"v": 1, "kind": "k"}, use_bin_type=True), "bad_envelope"),
    # describing a value nested about a thousand deep raised RecursionError
    "deep_version": (_raw_env(deep(1000, 0), "v"), "bad_version"),
    "deep_spec": (_raw_env(b"\x91" + deep(1000, 0), "tensors"), "bad_tensor"),
    "deep_shape": (_raw_env(b"\x91\x94\xa1a\xa7float32" + deep(1010, 1) + b"\x00", "tensors"), "bad_tensor"),
    # an empty tensor whose other dims overflow torch's strides raised RuntimeError in as_tensor
    "empty_tensor_stride_overflow": (msgpack.packb(_env(tensors=[["a", "float64", [0, 2**39, 2**39], 0]])),
                                     "bad_tensor"),
    "empty_tensor_storage_overflow": (msgpack.packb(_env(tensors=[["a", "uint8", [2**39, 2**39, 2**39, 0], 0]])),
                                      "bad_tensor"),
    # True == 1 and 1.0 == 1: a version of the wrong type was accepted
    "version_true": (msgpack.packb(_env(v=True)), "bad_version"),
    "version_float": (msgpack.packb(_env(v=1.0)), "bad_version"),
    # msgpack decodes extension type -1 (timestamps) itself, without asking ext_hook
    "timestamp_in_meta": (msgpack.packb(_env(meta={"t": [msgpack.Timestamp(1, 2)]})), "bad_envelope"),
    "timestamp_raw": (_raw_env(b"\x81\xa1t\xd6\xff\x00\x00\x00\x01", "meta"), "bad_envelope"),
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regressions_are_rejected_with_a_reason(name):
    buf, reason = REGRESSIONS[name]
    assert check_envelope(buf) == reason


def test_oversized_envelope_and_empty_tensor_edges():
    assert check_envelope(b"\xc4" + bytes(MAX_ENVELOPE)) == "oversized"
    # empty tensors that torch can lay out are still accepted
    ok = [["a", "float64", [0, 2**39], 0], ["b", "uint8", [2**20, 0, 2**20], 0], ["c", "bool", [0] * 8, 0]]
    assert check_envelope(msgpack.packb(_env(tensors=ok))) is None


# -- socket-level fuzz ------------------------------------------------------------------------

SOCKET_MAX_BYTES = 1 << 20  # per message; every frame sent stays below the socket's hard limit


class WireFuzzer:
    """A seeded stream of valid and malformed multipart messages (lists of bytes)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.seq = 0

    def text(self, n: int = 8) -> str:
        r = self.rng
        return "".join(chr(r.randrange(0x20, 0x7F) if r.random() < 0.8 else r.randrange(0xA0, 0x2FFF))
                       for _ in range(r.randrange(n + 1)))

    def value(self, depth: int = 0, plain: bool = False):
        r = self.rng
        k = r.randrange(10 if depth > 2 else 12 if plain else 14)
        if k < 8:
            return [None, True, False, r.choice(INTERESTING_INTS), r.randint(-9, 9), r.uniform(-1e9, 1e9),
                    self.text(), r.randbytes(r.randrange(9))][k]
        if k < 10:
            return float(r.choice(["nan", "inf", "-inf", "-0.0"])) if k == 8 else r.choice(INTERESTING_INTS)
        if k == 10:
            return [self.value(depth + 1, plain) for _ in range(r.randrange(4))]
        if k == 11:
            return {self.text(4): self.value(depth + 1, plain) for _ in range(r.randrange(4))}
        if k == 12:
            return msgpack.ExtType(r.randrange(128), r.randbytes(r.randrange(5)))
        return msgpack.Timestamp(r.randrange(2**34), r.randrange(10**9))

    def tensors(self) -> dict[str, torch.Tensor]:
        r = self.rng
        out = {}
        for i in range(r.randrange(5)):
            dtype = r.choice(DTYPE_NAMES)
            if r.random() < 0.1:  # big enough for the receiver's zero-copy path
                shape = [r.randrange((64 << 10) // ITEMSIZE[dtype], (160 << 10) // ITEMSIZE[dtype])]
            else:
                shape = [r.randrange(6) for _ in range(r.randrange(4))]
            nbytes = math.prod(shape) * ITEMSIZE[dtype]
            data = bytearray(r.randbytes(nbytes))
            if dtype == "bool":
                data = bytearray(data.translate(bytes(b & 1 for b in range(256))))
            t = torch.frombuffer(data, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            out[f"t{i}" if r.random() < 0.9 else self.text(5) or "x"] = t.view(DTYPES[dtype]).reshape(shape)
        return out

    def valid(self, sender: str = "fuzz") -> list[bytes]:
        meta = {self.text(5): self.value(plain=True) for _ in range(self.rng.randrange(3))}
        meta.update(sender=sender, seq=self.seq)
        self.seq += 1
        kind = self.text() if self.rng.random() < 0.5 else "rollout"
        return [bytes(f) for f in encode(kind if kind != HEARTBEAT_KIND else "rollout", self.tensors(), meta)]

    def broken_env(self, env: dict) -> dict:
        """``env`` with one field broken: a key missing or extra, a value of the wrong type,
        or one tensor spec with a wrong type, unknown dtype, absurd dims or byte count, or
        a duplicate name. ``env`` may already be broken itself."""
        r = self.rng
        env = dict(env)
        tensors = env.get("tensors")
        specs = [list(s) if isinstance(s, list) else s for s in tensors] if isinstance(tensors, list) else []
        well_formed = [s for s in specs if isinstance(s, list) and len(s) == 4]
        what = r.randrange(12)
        if what == 0:
            env[r.choice(ENVELOPE_KEYS)] = self.value()
        elif what == 1:
            env.pop(r.choice(ENVELOPE_KEYS), None)
        elif what == 2:
            env[r.choice([self.text(3), b"v", b"tensors", 7, None])] = self.value()
        elif what == 3:
            env["v"] = r.choice([0, 1, 3, -1, 2**64 - 1, True, 1.0, "1", b"\x01", [1], None])
        elif what == 4:
            env["kind"] = r.choice([None, 3, b"rollout", ["rollout"], {}])
        elif what == 5:
            env["meta"] = r.choice([None, [], "meta", 0, {1: 2}, {"sender": "fuzz", "seq": 0, "t": self.value()}])
        elif well_formed and what < 11:
            s = r.choice(well_formed)
            size = s[3] if type(s[3]) is int else 0
            if what == 6:  # wrong type in one field
                s[r.randrange(4)] = r.choice([None, 1.5, [], {}, b"a", True, -1, "", self.value()])
            elif what == 7:  # unknown dtype, unchanged sizes
                s[1] = r.choice(["object", "complex64", "uint16", "float", "Float32", "int4"])
            elif what == 8:  # negative or huge dims, with the byte count they would need
                s[2] = [r.choice([0, 1, 3, -1, 2**31, 2**39, 2**40, 2**63 - 1]) for _ in range(r.randrange(1, 10))]
                need = math.prod(s[2]) * (ITEMSIZE.get(s[1], 1) if isinstance(s[1], str) else 1)
                s[3] = need if -(2**63) <= need < 2**64 else 2**64 - 1
            elif what == 9:  # byte count off, or absurd
                s[3] = r.choice([max(size - 1, -1), min(size + 1, 2**64 - 1), -1, 2**63, 2**64 - 1,
                                 SOCKET_MAX_BYTES + 1])
            else:  # duplicate or non-string name, or a malformed spec
                s[:] = r.choice([[well_formed[0][0]] + s[1:], [7] + s[1:], s[:3], s + [0], []])
            env["tensors"] = specs
        else:
            env["tensors"] = r.choice([None, {}, "t", [None], [[]], specs * 2 if specs else [0]])
        return env

    def malformed(self) -> list[bytes]:
        r = self.rng
        frames = self.valid(r.choice(["fuzz", "other"]))
        head, data = frames[0], frames[1:]
        what = r.randrange(12)
        if what == 0:  # random frames
            return [r.randbytes(r.choice([0, 1, 8, r.randrange(300), 70_000])) for _ in range(r.randint(1, 6))]
        if what == 1:  # empty frames
            return [b""] * r.randint(1, 4) if r.random() < 0.5 else [head] + [b""] * r.randint(1, 4)
        if what == 2:  # data frames missing
            return [head] + (data[:r.randrange(len(data))] if data and r.random() < 0.7 else [])
        if what == 3:  # extra data frames
            return frames + [r.randbytes(r.randrange(20)) for _ in range(r.randint(1, 3))]
        if what == 4 and data:  # a data frame of the wrong size (or, by chance, swapped intact)
            i = r.randrange(len(data))
            how = r.randrange(4)
            data[i] = [data[i][:-1], data[i] + b"\x00", b"", data[-1]][how]
            if how == 3:
                data[-1] = frames[1 + i]
            return [head] + data
        if what == 5:  # mutated envelope, data frames as they were
            return [mutate_bytes(r, head)] + data
        if what == 6:  # msgpack-valid envelope that breaks the schema
            env = msgpack.unpackb(head)
            return [msgpack.packb(self.broken_env(env), use_bin_type=True)] + data
        if what == 7:  # meta without a usable sender or seq
            env = msgpack.unpackb(head)
            key = r.choice(["sender", "seq"])
            if r.random() < 0.5:
                env["meta"].pop(key)
            else:
                env["meta"][key] = r.choice([None, 1.5, "3", b"fuzz", [], 7 if key == "sender" else "s"])
            return [msgpack.packb(env, use_bin_type=True)] + data
        if what == 8:  # huge declared sizes: over the limit, or under it but never sent
            n = r.randint(1, SOCKET_MAX_BYTES // 65535)
            specs = [[f"h{i}", "uint8", [65535], 65535] for i in range(n)]
            if r.random() < 0.5:
                specs.append(["big", "float32", [2**20, 2**20], 2**42])
            env = {"v": PROTOCOL_VERSION, "kind": "rollout", "meta": {"sender": "fuzz", "seq": 0}, "tensors": specs}
            return [msgpack.packb(env)] + [bytes(65535)] * r.randrange(n)
        if what == 9:  # a value nested about as deep as msgpack allows, somewhere
            key = r.choice(ENVELOPE_KEYS)
            env = msgpack.unpackb(head)
            raw = deep(r.choice([r.randrange(1100), r.randrange(990, 1030)]), r.randrange(3))
            items = [msgpack.packb(k) + (raw if k == key else msgpack.packb(v, use_bin_type=True))
                     for k, v in env.items()]
            return [b"\x84" + b"".join(items)] + data
        if what == 10:  # extension objects in meta
            env = msgpack.unpackb(head)
            env["meta"][self.text(3) or "x"] = r.choice([msgpack.ExtType(r.randrange(128), b"x"),
                                                         msgpack.Timestamp(r.randrange(2**34), 0)])
            return [msgpack.packb(env, use_bin_type=True)] + data
        # an oversized envelope frame
        return [b"\xc6" + (MAX_ENVELOPE + 10).to_bytes(4, "big") + bytes(MAX_ENVELOPE + 10)] + data


class Connection:
    """What the receiver knows of one connection (planes/identity.py): the name it claimed
    first, the last ``seq`` and the messages that arrived on it (rejected ones included)."""

    def __init__(self, max_in_flight: int):
        self.name, self.last_seq, self.arrived, self.max_in_flight = None, -1, 0, max_in_flight

    def admit(self, fate: tuple[str, object], frames: list[bytes]) -> tuple[str, object]:
        self.arrived += 1
        if fate[0] == "rejected":
            return fate
        _, meta, _ = decode_envelope(frames[0], SOCKET_MAX_BYTES)
        sender, seq = meta["sender"], meta["seq"]
        if self.name is None:
            self.name = sender
        if sender != self.name:
            return "rejected", "spoofed_sender"
        ceiling = self.arrived + self.max_in_flight
        if fate[0] == "heartbeat":
            sent = meta.get("sent")
            if not isinstance(sent, int) or isinstance(sent, bool) or not 0 <= sent <= ceiling:
                return "rejected", "implausible_count"
            return fate
        if seq <= self.last_seq or seq >= ceiling:
            return "rejected", "implausible_count"
        self.last_seq = seq
        return fate


def predict(frames: list[bytes], conn: Connection | None = None) -> tuple[str, object]:
    """What the receiver must do with ``frames``, from the wire format: ("rejected", reason),
    ("heartbeat", None) or ("delivered", (kind, meta, tensors)). Data frames are checked one
    by one in order, as a receiver that reads them in turn meets them. With ``conn``, the
    connection's identity and counts are checked too (and updated)."""
    fate = _predict(frames)
    return fate if conn is None else conn.admit(fate, frames)


def _predict(frames: list[bytes]) -> tuple[str, object]:
    try:
        kind, meta, specs = decode_envelope(frames[0], SOCKET_MAX_BYTES)
    except MessageError as exc:
        return "rejected", exc.reason
    data, sizes = frames[1:], frame_sizes(specs)
    for i, size in enumerate(sizes):
        if i >= len(data):
            return "rejected", "bad_frames"
        if len(data[i]) != size:
            return "rejected", "bad_tensor"
    if len(data) > len(sizes):
        return "rejected", "bad_frames"
    if not isinstance(meta.get("sender"), str) or not isinstance(meta.get("seq"), int):
        return "rejected", "bad_envelope"
    if kind == HEARTBEAT_KIND:
        return "heartbeat", None
    return "delivered", (kind, meta, dict(zip((s.name for s in specs), tensor_bytes(specs, data))))


def same_message(msg, expected) -> bool:
    kind, meta, tensors = expected
    return (msg.kind == kind and msgpack.packb(msg.meta) == msgpack.packb(meta)
            and msg.sender == meta["sender"] and msg.seq == meta["seq"]
            and list(msg.tensors) == list(tensors)
            and all(raw_bytes(msg.tensors[k]) == v for k, v in tensors.items()))


class Collector:
    """Calls ``get`` in a thread of its own, as a learner would, recording what it returns
    and anything it raises."""

    def __init__(self, rx: TrajectoryReceiver):
        self.rx = rx
        self.got: list = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                msg = self.rx.get(timeout=0.05)
            except BaseException as exc:  # the receiver thread died
                self.errors.append(exc)
                return
            if msg is not None:
                self.got.append(msg)

    def wait_for(self, pred, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while not pred(self.got) and not self.errors and time.monotonic() < deadline:
            time.sleep(0.01)
        return pred(self.got)

    def stop(self):
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def quiet_receiver_log(caplog):
    caplog.set_level(logging.CRITICAL, logger="dvla.planes.data")  # thousands of rejections


def _raw_push(rx: TrajectoryReceiver) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)  # fail rather than hang if the receiver stops reading
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(rx.endpoints["ipc"])
    return sock


N_MALFORMED = 3000


@pytest.mark.timeout(120)
def test_receiver_survives_thousands_of_malformed_messages(quiet_receiver_log):
    fuzz = WireFuzzer(seed=20240607)
    cfg = DataPlaneConfig(transport="ipc", max_message_bytes=SOCKET_MAX_BYTES)
    t0 = time.monotonic()
    with TrajectoryReceiver(cfg) as rx:
        raw = _raw_push(rx)
        collector = Collector(rx)
        delivered, rejected, heartbeats, valid_by_chance = [], collections.Counter(), 0, 0
        n_malformed = 0
        conn = Connection(rx.peers.max_in_flight)
        try:
            while n_malformed < N_MALFORMED:
                is_valid = fuzz.rng.random() < 0.2
                frames = fuzz.valid() if is_valid else fuzz.malformed()
                n_malformed += not is_valid
                fate, detail = predict(frames, conn)
                if is_valid and conn.name == "fuzz":  # (a mutant may have bound another name first)
                    assert fate == "delivered", detail
                if fate == "delivered":
                    delivered.append(detail)
                    valid_by_chance += not is_valid
                elif fate == "rejected":
                    rejected[detail] += 1
                else:
                    heartbeats += 1
                raw.send_multipart(frames)
            end = fuzz.valid(sender=conn.name)  # same socket, so it arrives after all of the above
            delivered.append(predict(end, conn)[1])
            raw.send_multipart(end)

            arrived = collector.wait_for(lambda got: len(got) >= len(delivered))
            assert not collector.errors, collector.errors  # get() never raised: the receiver thread lives
            assert arrived, (len(collector.got), len(delivered))
            assert rx._thread.is_alive()
            assert len(collector.got) == len(delivered)
            for i, (msg, expected) in enumerate(zip(collector.got, delivered)):
                assert same_message(msg, expected), i  # every valid message, intact, in order
            assert rx.counters.rejected == rejected, (dict(rx.counters.rejected), dict(rejected))
            assert sum(rx.counters.rejected.values()) == n_malformed - valid_by_chance - heartbeats
            assert rx.counters.received == len(delivered)
            # the fuzz is not vacuous: every reason is exercised and almost all mutations are malformed
            assert REASONS <= set(rejected) and valid_by_chance + heartbeats < N_MALFORMED // 20, rejected

            # afterwards a real sender on a fresh socket is still served
            tensors = {"image": torch.randint(0, 256, (4, 3, 64, 64), dtype=torch.uint8), "x": torch.randn(5)}
            with TrajectorySender(rx.endpoints, cfg, sender_id="after") as tx:
                tx.send("rollout", tensors, {"i": 1})
                assert collector.wait_for(lambda got: len(got) > len(delivered), timeout=10)
            msg = collector.got[-1]
            assert msg.sender == "after" and all(torch.equal(msg.tensors[k], v) for k, v in tensors.items())
            assert not collector.errors and rx._thread.is_alive()
        finally:
            collector.stop()
            raw.close()
    assert time.monotonic() - t0 < 60


@pytest.mark.timeout(60)
def test_receiver_survives_the_regression_inputs(quiet_receiver_log):
    """Every input that used to raise something other than MessageError in the decoder
    would have killed the receiver thread; each is now counted and skipped."""
    with TrajectoryReceiver(DataPlaneConfig(transport="ipc")) as rx:
        raw = _raw_push(rx)
        collector = Collector(rx)
        try:
            for name in sorted(REGRESSIONS):
                raw.send_multipart([REGRESSIONS[name][0]])
            good = encode("rollout", {"x": torch.arange(3)}, {"sender": "s", "seq": 0})
            raw.send_multipart(good)
            arrived = collector.wait_for(lambda got: len(got) == 1, timeout=10)
            assert not collector.errors and rx._thread.is_alive(), collector.errors
            assert arrived
            assert rx.counters.rejected == collections.Counter(reason for _, reason in REGRESSIONS.values())
        finally:
            collector.stop()
            raw.close()


@pytest.mark.timeout(60)
def test_declared_but_unsent_bytes_cost_the_receiver_nothing(quiet_receiver_log):
    """An envelope of about 80 KiB can declare 256 MiB of small tensors and send none of
    them. The receiver must not allocate (and zero) memory for bytes that never arrive,
    or a peer can make it do that work at will. Measured with tracemalloc, which sees
    Python allocations made by the receiver thread."""
    cfg = DataPlaneConfig(transport="ipc", max_message_bytes=1 << 28)
    specs = [[f"t{i}", "uint8", [65535], 65535] for i in range(4096)]
    lie = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "rollout", "meta": {"sender": "s", "seq": 0},
                         "tensors": specs})
    with TrajectoryReceiver(cfg) as rx:
        raw = _raw_push(rx)
        collector = Collector(rx)
        tracemalloc.start()
        try:
            for _ in range(4):
                raw.send(lie)
            raw.send_multipart(encode("rollout", {"x": torch.arange(3)}, {"sender": "s", "seq": 1}))
            arrived = collector.wait_for(lambda got: len(got) == 1, timeout=30)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            collector.stop()
            raw.close()
        assert not collector.errors and arrived
        assert rx.counters.rejected == {"bad_frames": 4}
        assert peak < 32 << 20, f"{peak >> 20} MiB allocated while rejecting envelopes that carry no data"
