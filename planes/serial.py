"""Wire format of the data plane: a msgpack envelope, then the tensors' bytes in raw frames.

A message is a list of ZeroMQ frames::

    frame 0    msgpack map {"v": PROTOCOL_VERSION, "kind": str, "meta": map,
                            "tensors": [[name, dtype, shape, nbytes], ...]}
    packed     present when some tensor has fewer than PACK_LIMIT bytes: all such tensors,
               in the order listed, each starting at a multiple of PACK_ALIGN bytes
               (zero padding between them, none after the last)
    then       one frame per tensor of PACK_LIMIT bytes or more, in the order listed,
               C-contiguous

The layout follows from the envelope alone (:func:`layout`), so a receiver knows the size of
every frame before it reads one. Small tensors (proprioception, actions, rewards, masks)
share a frame because every frame costs a send and a receive call and a ZeroMQ message on
each side, whatever its size; copying a few KiB into the packed frame is cheaper. Large
tensors (images) are not copied: each frame is a ``memoryview`` over the tensor's own
storage, and pyzmq holds the memoryview (so the tensor) until libzmq has sent it. Decoding
wraps the received buffers without a copy, as numpy views handed to ``torch.from_numpy``.

Nothing here ever unpickles. Decoding is strict: the protocol version, the number of
frames, every dtype (from an allow-list), shape and byte count, each frame's size, the
message size and the msgpack types are all checked, and any violation raises
:class:`MessageError` with a reason that names the problem. msgpack extension types are
refused, timestamps (type -1) included; error messages quote received values through a
bounded ``reprlib`` repr.
"""

from __future__ import annotations

import ctypes
import math
import reprlib
import warnings
from typing import Any, NamedTuple, Sequence

import msgpack
import numpy
import torch
from torch import Tensor

PROTOCOL_VERSION = 2  # 2: small tensors packed into one frame (1: one frame per tensor)
DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB per message
PACK_LIMIT = 64 * 1024  # tensors below this many bytes travel in the packed frame
PACK_ALIGN = 64  # each packed tensor starts on this boundary (any dtype's alignment)

DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ITEMSIZE = {v: torch.empty((), dtype=v).element_size() for v in DTYPES.values()}
# numpy's dtype of the same item layout: received tensors are built as numpy views (several
# times cheaper per tensor than torch.frombuffer); bfloat16 goes as int16, then is viewed.
_NUMPY_DTYPES = {v: numpy.dtype(k if k != "bfloat16" else "int16") for k, v in DTYPES.items()}
_memmove = ctypes.memmove
# Received frames are read-only; decoded tensors share their memory (clone to modify).
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
_MAX_ENVELOPE = 1 << 20  # 1 MiB of metadata is plenty
_MAX_DIMS = 8
_CACHE_MAX = 256  # entries of each of the encode and decode caches
# Error messages quote what was received through a bounded repr: a plain repr of a hostile
# envelope could be megabytes long, or nested deeper than the recursion limit allows.
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxother, _QUOTE.maxlong = 3, 40, 40, 40


class TensorSpec(NamedTuple):
    """One entry of the envelope's tensor list, validated."""

    name: str
    dtype: torch.dtype
    shape: list[int]
    nbytes: int


class MessageError(ValueError):
    """A received message violates the wire format; ``reason`` is a short category."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class _Plan(NamedTuple):
    """How a tensor list of given names, dtypes and shapes is encoded (see :func:`encode`)."""

    specs: bytes  # the msgpack bytes of the envelope's tensor list
    packed_size: int | None
    offsets: list[int | None]  # as in :func:`layout`
    nbytes: list[int]


# Senders send the same names, dtypes and shapes message after message: their envelope
# bytes and packed layout are kept, keyed by exactly those.
_PLANS: dict[tuple, _Plan] = {}
_ENV_V = msgpack.packb("v") + msgpack.packb(PROTOCOL_VERSION) + msgpack.packb("kind")
_ENV_META, _ENV_TENSORS = msgpack.packb("meta"), msgpack.packb("tensors")


def _plan(key: tuple) -> _Plan:
    specs = []
    for name, dtype, shape in key:
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {dtype}")
        specs.append([name, _DTYPE_NAMES[dtype], list(shape), math.prod(shape) * _ITEMSIZE[dtype]])
    checked = [TensorSpec(n, d, sh, nb) for (n, d, sh), (_, _, _, nb) in zip(key, specs)]
    packed_size, offsets = layout(checked)
    return _Plan(msgpack.packb(specs, use_bin_type=True), packed_size, offsets, [s[3] for s in specs])


def encode(kind: str, tensors: dict[str, Tensor], meta: dict[str, Any] | None = None) -> list[Any]:
    """Frames for one message. Tensors must be on the CPU; non-contiguous ones are
    made contiguous (that one case copies a large tensor). Tensors below
    :data:`PACK_LIMIT` bytes are copied into the packed frame (a numpy ``uint8`` array),
    the others are ``memoryview`` frames over their own memory."""
    ts, key = [], []
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if not t.is_cpu:
            raise ValueError(f"tensor {name!r} is on {t.device}; move it to the CPU before sending")
        if not t.is_contiguous():
            t = t.contiguous()
        ts.append(t)
        key.append((name, t.dtype, t.shape))
    key = tuple(key)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(key)
        if len(_PLANS) >= _CACHE_MAX:
            _PLANS.clear()
        _PLANS[key] = plan
    # The envelope map, byte for byte what msgpack.packb would make of
    # {"v": ..., "kind": kind, "meta": meta, "tensors": specs}.
    frames: list[Any] = [b"".join((b"\x84", _ENV_V, msgpack.packb(kind, use_bin_type=True), _ENV_META,
                                   msgpack.packb(meta or {}, use_bin_type=True), _ENV_TENSORS, plan.specs))]
    if plan.packed_size is not None:
        packed = numpy.zeros(plan.packed_size, dtype=numpy.uint8)  # zero padding between the tensors
        base = packed.__array_interface__["data"][0]  # several times cheaper than packed.ctypes.data
        for t, off, n in zip(ts, plan.offsets, plan.nbytes):
            if off is not None and n:  # contiguous, on the CPU, n bytes from data_ptr(): checked above
                _memmove(base + off, t.data_ptr(), n)
        frames.append(packed)
    frames.extend(_bytes_of(t) for t, off in zip(ts, plan.offsets) if off is None)
    return frames


def _bytes_of(t: Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor's memory (no copy)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret as bytes
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())
    return memoryview(t.numpy()).cast("B")


def _pack_offsets(sizes) -> tuple[int, list[int]]:
    """Offsets of tensors of ``sizes`` bytes in the packed frame, and the frame's size.
    Empty tensors take no room (offset 0)."""
    end, offsets = 0, []
    for n in sizes:
        if n:
            off = -(-end // PACK_ALIGN) * PACK_ALIGN
            offsets.append(off)
            end = off + n
        else:
            offsets.append(0)
    return end, offsets


def layout(specs: Sequence[TensorSpec]) -> tuple[int | None, list[int | None]]:
    """Where each tensor of a message travels: ``(packed_size, offsets)``. ``packed_size``
    is the size of the packed frame, or None when the message has none; ``offsets[i]`` is
    tensor i's offset in the packed frame, or None when it has a frame of its own."""
    packed = [i for i, s in enumerate(specs) if s.nbytes < PACK_LIMIT]
    offsets: list[int | None] = [None] * len(specs)
    if not packed:
        return None, offsets
    size, offs = _pack_offsets(specs[i].nbytes for i in packed)
    for i, off in zip(packed, offs):
        offsets[i] = off
    return size, offsets


def _reject_ext(code: int, data: bytes) -> Any:
    raise MessageError("bad_envelope", f"msgpack extension type {code} is not allowed")


def decode(frames: list[Any], max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    """Validate and unpack a message: ``(kind, meta, tensors)``. Raises :class:`MessageError`."""
    if not frames:
        raise MessageError("bad_envelope", "empty message")
    kind, meta, (specs, packed_size, offsets, _) = decode_head(_buffer(frames[0]), max_bytes)
    expected = (packed_size is not None) + sum(off is None for off in offsets)
    if len(frames) != expected + 1:
        raise MessageError("bad_frames", f"{len(specs)} tensors need {expected} data frames, "
                                         f"{len(frames) - 1} received")
    data = iter(frames[1:])
    packed = None
    if packed_size is not None:
        packed = _buffer(next(data))
        check_packed(packed_size, memoryview(packed).nbytes)
    tensors: dict[str, Tensor] = {}
    for spec, off in zip(specs, offsets):
        if off is None:
            buf = _buffer(next(data))
            check_frame(spec, memoryview(buf).nbytes)
            tensors[spec.name] = as_tensor(buf, spec)
        else:
            tensors[spec.name] = as_tensor(packed, spec, off)
    return kind, meta, tensors


def decode_envelope(head: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[str, dict[str, Any], list[TensorSpec]]:
    """Validate frame 0 alone: ``(kind, meta, specs)``, each spec's byte count checked against
    its dtype and shape and their sum against ``max_bytes``, so that a receiver knows how big
    every data frame must be before reading it. Raises :class:`MessageError`."""
    kind, meta, lay = decode_head(head, max_bytes)
    return kind, meta, list(lay.specs)


class Layout(NamedTuple):
    """A validated tensor list and where its tensors travel (see :func:`layout`)."""

    specs: tuple[TensorSpec, ...]
    packed_size: int | None
    offsets: list[int | None]
    nbytes: int


# Senders send the same tensor list message after message; its validation and layout are
# kept, keyed by the list's exact msgpack bytes (so 1, 1.0 and true stay different keys).
_LAYOUTS: dict[bytes, Layout | MessageError] = {}


def decode_head(head: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[str, dict[str, Any], Layout]:
    """:func:`decode_envelope` with the specs in the message's :class:`Layout`, which is
    shared with later messages that declare the same tensors (do not modify it)."""
    if memoryview(head).nbytes > _MAX_ENVELOPE:
        raise MessageError("oversized", f"envelope of {memoryview(head).nbytes} bytes exceeds {_MAX_ENVELOPE}")
    try:
        env = msgpack.unpackb(head, raw=False, strict_map_key=True, ext_hook=_reject_ext)
    except MessageError:
        raise
    except Exception as exc:  # msgpack raises several exception types on garbage
        raise MessageError("bad_envelope", f"not a msgpack envelope ({type(exc).__name__}: {exc})") from None
    if not isinstance(env, dict) or set(env) != {"v", "kind", "meta", "tensors"}:
        keys = _quote(list(env)) if isinstance(env, dict) else type(env).__name__  # str and bytes keys: unsortable
        raise MessageError("bad_envelope", f"envelope must have keys v, kind, meta, tensors; got {keys}")
    if type(env["v"]) is not int or env["v"] != PROTOCOL_VERSION:  # not True, not 1.0
        raise MessageError("bad_version", f"protocol version {_quote(env['v'])}, expected {PROTOCOL_VERSION}")
    kind, meta, raw_specs = env["kind"], env["meta"], env["tensors"]
    if not isinstance(kind, str) or not isinstance(meta, dict) or not isinstance(raw_specs, list):
        raise MessageError("bad_envelope", "kind must be a string, meta a map and tensors a list")
    _reject_timestamps(meta)
    try:
        key = msgpack.packb(raw_specs, use_bin_type=True)  # what was unpacked packs again
    except Exception:  # but should it not, validate without the cache
        key = None
    known = _LAYOUTS.get(key) if key is not None else None
    if known is None:
        try:
            known = _check_specs(raw_specs)
        except MessageError as exc:
            known = exc
        if key is not None:
            if len(_LAYOUTS) >= _CACHE_MAX:
                _LAYOUTS.clear()
            _LAYOUTS[key] = known
    if isinstance(known, MessageError):  # a fresh one: re-raising one object grows its traceback
        raise MessageError(known.reason, known.detail)
    if known.nbytes > max_bytes:
        raise MessageError("oversized", f"message exceeds {max_bytes} bytes")
    return kind, meta, known


def _check_specs(raw_specs: list) -> Layout:
    specs = tuple(_check_spec(s) for s in raw_specs)
    if len({s.name for s in specs}) != len(specs):
        raise MessageError("bad_tensor", f"duplicate tensor name in {_quote([s.name for s in specs])}")
    return Layout(specs, *layout(specs), sum(s.nbytes for s in specs))


def check_frame(spec: TensorSpec, size: int) -> None:
    """A data frame of ``size`` bytes must hold exactly the tensor its spec declares."""
    if size != spec.nbytes:
        raise MessageError("bad_tensor", f"tensor {_quote(spec.name, 40)}: {spec.dtype} {spec.shape} needs "
                                         f"{spec.nbytes} bytes, frame has {size}")


def check_packed(expected: int, size: int) -> None:
    """The packed frame must be exactly as long as the layout of the envelope says."""
    if size != expected:
        raise MessageError("bad_tensor", f"packed frame of the small tensors needs {expected} bytes, "
                                         f"frame has {size}")


def as_tensor(buf: Any, spec: TensorSpec, offset: int = 0) -> Tensor:
    """The tensor ``spec`` describes, sharing the memory of ``buf`` from byte ``offset`` on
    (the caller has checked that the bytes are there). Built as a numpy view, several times
    cheaper per tensor than ``torch.frombuffer``; writable exactly when ``buf`` is."""
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    t = torch.from_numpy(numpy.ndarray(spec.shape, _NUMPY_DTYPES[spec.dtype], buf, offset))
    return t.view(torch.bfloat16) if spec.dtype == torch.bfloat16 else t


def _buffer(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


def _quote(value: Any, limit: int = 80) -> str:
    return _QUOTE.repr(value)[:limit]


def _reject_timestamps(meta: dict) -> None:
    """msgpack decodes extension type -1 (timestamps) itself, without calling ``ext_hook``;
    meta is the only field where one can hide (the others are type-checked), so look there.
    Iterative: meta may be nested as deep as msgpack allows."""
    stack: list[Any] = [meta]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, msgpack.Timestamp):
            raise MessageError("bad_envelope", "msgpack extension type -1 (timestamp) is not allowed")


def _check_spec(spec: Any) -> TensorSpec:
    if not (isinstance(spec, list) and len(spec) == 4):
        raise MessageError("bad_tensor", f"tensor spec must be [name, dtype, shape, nbytes], got {_quote(spec)}")
    name, dtype, shape, nbytes = spec
    if not isinstance(name, str) or not name:
        raise MessageError("bad_tensor", f"tensor name must be a non-empty string, got {_quote(name, 40)}")
    if not isinstance(dtype, str) or dtype not in DTYPES:  # a list here is unhashable
        raise MessageError("bad_tensor", f"tensor {_quote(name, 40)}: dtype {_quote(dtype, 40)} "
                                         f"not in {sorted(DTYPES)}")
    if (type(shape) is not list or len(shape) > _MAX_DIMS  # type() is: bool is not a size
            or not all(type(d) is int and 0 <= d < 2**40 for d in shape)):
        raise MessageError("bad_tensor", f"tensor {_quote(name, 40)}: bad shape {_quote(shape)}")
    if type(nbytes) is not int or nbytes < 0:
        raise MessageError("bad_tensor", f"tensor {_quote(name, 40)}: bad byte count {_quote(nbytes, 40)}")
    itemsize = _ITEMSIZE[DTYPES[dtype]]
    expect = math.prod(shape) * itemsize
    if nbytes != expect:
        raise MessageError("bad_tensor", f"tensor {_quote(name, 40)}: shape {shape} {dtype} needs "
                                         f"{_quote(expect, 40)} bytes, declared {_quote(nbytes, 40)}")
    # An empty tensor still gets strides (products of the other dims, in bytes); torch
    # refuses to build one whose strides overflow int64, so neither do we accept it.
    if expect == 0 and math.prod(max(d, 1) for d in shape) * itemsize >= 2**63:
        raise MessageError("bad_tensor", f"tensor {_quote(name, 40)}: empty, but shape {shape} is too large")
    return TensorSpec(name, DTYPES[dtype], shape, nbytes)
