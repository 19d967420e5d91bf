"""The data plane's configuration, owned here so that :mod:`planes` imports nothing from
the packages above it (``dvla.config`` composes it into a job's configuration)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal


TRANSPORTS = ("auto", "ipc", "tcp")


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
    send_hwm: int = 8
    """Messages a sender may have queued before ``send`` blocks."""
    recv_hwm: int = 8
    """Messages ZeroMQ may buffer at the receiver."""
    recv_queue: int = 8
    """Decoded messages the receiver's background thread may prefetch while the consumer is
    busy; when full it stops reading (a consumer waiting in ``get`` reads for itself).
    The swimlane sets it from ``swimlane.queue_size``."""
    max_message_bytes: int = 1 << 30  # planes.serial.DEFAULT_MAX_BYTES
    """Largest accepted message; bigger ones are rejected unread. A training job lowers it
    to its largest legal chunk plus a margin."""
    max_frame_bytes: int = 0
    """Largest frame libzmq accepts (``ZMQ_MAXMSGSIZE``); a peer that sends a bigger one is
    disconnected before it is buffered. 0: ``max_message_bytes``. A training job sets it
    to its largest tensor plus a margin."""
    send_timeout_s: float = 60.0
    """Longest a send may block on backpressure before it fails."""
    heartbeat_s: float = 0.5
    """Interval of sender heartbeats (on their own socket)."""
    peer_timeout_s: float = 5.0
    """A sender unheard for this long is declared dead."""
    keep_receive_buffers: bool = True
    """On Linux with glibc, let the receiving process keep freed memory for reuse: malloc's
    mmap threshold goes to 32 MiB and its trim threshold to 32 MiB (``mallopt``, process
    wide, once), so ZeroMQ's multi-MB receive buffers come from memory already mapped
    instead of fresh pages that fault in on every message. False leaves malloc alone."""
    curve: bool = False
    """Encrypt with CurveZMQ (the receiver's public key travels through the store)."""
    curve_authorized_dir: str | None = None
    """With ``curve``: only clients whose public keys (``*.key``) are in this directory may
    connect (others are refused and counted as ``curve_auth``). A training job needs
    ``curve_keys_dir`` with it."""
    curve_keys_dir: str | None = None
    """With ``curve``: where each rank finds its persistent client key
    (``secret/rank{N}.key_secret``, made by ``dvla keys DIR --ranks N``). Without it every
    sender makes a fresh key, which encrypts but can never be in ``curve_authorized_dir``."""

    def _validate(self) -> list[tuple[str, str]]:
        if self.transport not in TRANSPORTS:
            return [("transport", f"expected one of {', '.join(map(repr, TRANSPORTS))}, got {self.transport!r}")]
        errs = [(n, f"must be >= 1, got {getattr(self, n)}")
                for n in ("send_hwm", "recv_hwm", "recv_queue", "max_message_bytes") if getattr(self, n) < 1]
        if self.max_frame_bytes < 0:
            errs.append(("max_frame_bytes", f"must be >= 0, got {self.max_frame_bytes}"))
        if self.curve_authorized_dir is not None:
            if not self.curve:
                errs.append(("curve_authorized_dir", "needs curve=true"))
        if not 0 < self.heartbeat_s < self.peer_timeout_s:
            errs.append(("heartbeat_s", f"must be > 0 and below peer_timeout_s ({self.peer_timeout_s}), "
                                        f"got {self.heartbeat_s}"))
        return errs


def check(cfg: DataPlaneConfig, path: str = "data_plane.") -> None:
    """Raise :class:`DataPlaneConfigError` naming every out-of-range field of ``cfg``."""
    if not dataclasses.is_dataclass(cfg):
        raise DataPlaneConfigError(f"{path.rstrip('.')}: expected a DataPlaneConfig, got {cfg!r}")
    errs = cfg._validate()
    if errs:
        raise DataPlaneConfigError("invalid configuration: " + "; ".join(f"{path}{n}: {m}" for n, m in errs))
