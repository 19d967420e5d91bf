"""The data plane's configuration, owned here so that :mod:`planes` imports nothing from
the packages above it (``dvla.config`` composes it into a job's configuration).

Each numeric field declares its range in its metadata (``ge``/``gt``/``le``/``lt``, the keys
``dvla.config``'s rule reads for every section of a job); :func:`check`, for a plane used
on its own, reads the same keys."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal


TRANSPORTS = ("auto", "ipc", "tcp")
C_INT_MAX = 2**31 - 1  # ZeroMQ's int socket options (high-water marks, timeouts in ms)


class DataPlaneConfigError(ValueError):
    """A data-plane setting is out of range (the message names the field)."""


@dataclass(kw_only=True)
class DataPlaneConfig:
    """The ZeroMQ data plane (:mod:`planes.data`) that carries trajectory chunks between
    processes. The swimlane sets ``transport`` per route from the placement and
    ``recv_queue`` from ``swimlane.queue_size``."""

    transport: Literal["auto", "ipc", "tcp"] = "auto"
    """``auto`` (ipc on the same host, tcp across hosts), ``ipc`` or ``tcp``."""
    bind_host: str = "auto"
    """Where a learner's tcp endpoint binds: ``auto`` (loopback when every rank is on one
    host, else this host's address on the route to the rendezvous host, ``MASTER_ADDR``),
    an interface name (``eth0``), an IPv4 address, or ``0.0.0.0`` (every interface)."""
    advertise_host: str = "auto"
    """The address rollout ranks are told to dial (an IPv4 address or an interface name):
    ``auto`` is the bound address, or with ``bind_host=0.0.0.0`` the routed one. A loopback
    address told to ranks on other hosts is an error."""
    send_hwm: int = field(default=8, metadata={"ge": 1, "le": C_INT_MAX})
    """Messages a sender may have queued before ``send`` blocks."""
    recv_hwm: int = field(default=8, metadata={"ge": 1, "le": C_INT_MAX})
    """Messages ZeroMQ may buffer at the receiver."""
    recv_queue: int = field(default=8, metadata={"ge": 1})
    """Decoded messages the receiver's background thread may prefetch while the consumer is
    busy; when full it stops reading (a consumer waiting in ``get`` reads for itself).
    The swimlane sets it from ``swimlane.queue_size``."""
    max_message_bytes: int = field(default=1 << 30, metadata={"ge": 1, "le": 2**62})  # planes.serial.DEFAULT_MAX_BYTES
    """Largest accepted message; bigger ones are rejected unread. A training job lowers it
    to its largest legal chunk plus a margin."""
    max_frame_bytes: int = field(default=0, metadata={"ge": 0, "le": 2**62})
    """Largest frame libzmq accepts (``ZMQ_MAXMSGSIZE``); a peer that sends a bigger one is
    disconnected before it is buffered. 0: ``max_message_bytes``. A training job sets it
    to its largest tensor plus a margin."""
    send_timeout_s: float = field(default=60.0, metadata={"ge": 0, "le": C_INT_MAX // 1000})
    """Longest a send may block on backpressure before it fails."""
    heartbeat_s: float = field(default=0.5, metadata={"gt": 0})
    """Interval of sender heartbeats (on their own socket)."""
    peer_timeout_s: float = field(default=5.0, metadata={"gt": 0})
    """A sender unheard for this long is declared dead."""
    keep_receive_buffers: bool = True
    """On Linux with glibc, let the receiving process keep freed memory for reuse: malloc's
    mmap threshold goes to 32 MiB and its trim threshold to 32 MiB (``mallopt``, process
    wide, once), so ZeroMQ's multi-MB receive buffers come from memory already mapped
    instead of fresh pages that fault in on every message. False leaves malloc alone."""
    require_auth: bool = False
    """Refuse to start a receiver that would listen on tcp without
    ``curve_authorized_dir`` (without it, a multi-host job starts with one warning).
    On one host the data plane uses ipc in a directory only the job's user can open."""
    curve: bool = False
    """Encrypt with CurveZMQ (the receiver's public key travels through the store)."""
    curve_authorized_dir: str | None = None
    """With ``curve``: only clients whose public keys (``*.key``) are in this directory may
    connect (others are refused and counted as ``curve_auth``), each under its file's name
    (``rank3.key``: ``rank3``; a message claiming another name is rejected). A training job needs
    ``curve_keys_dir`` with it."""
    curve_keys_dir: str | None = None
    """With ``curve``: where each rank finds its persistent client key
    (``secret/rank{N}.key_secret``, made by ``dvla keys DIR --ranks N``). Without it every
    sender makes a fresh key, which encrypts but can never be in ``curve_authorized_dir``."""

    def _validate(self) -> list[tuple[str, str]]:
        """The rules that relate fields (each field's range is in its metadata)."""
        errs = []
        if self.curve_authorized_dir is not None and not self.curve:
            errs.append(("curve_authorized_dir", "needs curve=true"))
        if not self.heartbeat_s < self.peer_timeout_s:
            errs.append(("heartbeat_s", f"must be > 0 and below peer_timeout_s ({self.peer_timeout_s}), "
                                        f"got {self.heartbeat_s}"))
        return errs


def _num(x: float) -> str:
    if isinstance(x, int) and x >= 1 << 16 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    if isinstance(x, int) and x >= 1 << 16 and (x + 1) & x == 0:
        return f"2**{x.bit_length()} - 1"
    return repr(x)


def _range_errors(cfg: DataPlaneConfig) -> list[tuple[str, str]]:
    """Each numeric field against the range in its metadata, and finite: the rule
    ``dvla.config`` applies to every section of a job (same messages), for a plane used on
    its own."""
    errs = []
    for f in dataclasses.fields(cfg):
        value, meta, is_float = getattr(cfg, f.name), f.metadata, f.type in (float, "float")
        lo, hi = next((k for k in ("ge", "gt") if k in meta), None), next((k for k in ("le", "lt") if k in meta), None)
        if not (lo or hi):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float) if is_float else int):
            errs.append((f.name, f"expected {'float' if is_float else 'int'}, got {value!r}"))
            continue
        if not (math.isnan(value) or math.isinf(value) or (lo == "ge" and value < meta[lo])
                or (lo == "gt" and value <= meta[lo]) or (hi == "le" and value > meta[hi])
                or (hi == "lt" and value >= meta[hi])):
            continue
        if lo and hi:
            allowed = f"in {'[' if lo == 'ge' else '('}{_num(meta[lo])}, {_num(meta[hi])}{']' if hi == 'le' else ')'}"
        else:
            allowed = f"{dict(ge='>=', gt='>', le='<=', lt='<')[lo or hi]} {_num(meta[lo or hi])}" + \
                (" and finite" if is_float else "")
        errs.append((f.name, f"must be {allowed}, got {value!r}"))
    return errs


def check(cfg: DataPlaneConfig, path: str = "data_plane.") -> None:
    """Raise :class:`DataPlaneConfigError` naming every out-of-range field of ``cfg``."""
    if not dataclasses.is_dataclass(cfg):
        raise DataPlaneConfigError(f"{path.rstrip('.')}: expected a DataPlaneConfig, got {cfg!r}")
    if cfg.transport not in TRANSPORTS:
        raise DataPlaneConfigError(f"invalid configuration: {path}transport: expected one of "
                                   f"{', '.join(map(repr, TRANSPORTS))}, got {cfg.transport!r}")
    errs = _range_errors(cfg) or cfg._validate()
    if errs:
        raise DataPlaneConfigError("invalid configuration: " + "; ".join(f"{path}{n}: {m}" for n, m in errs))
