"""A ZAP handler (ZeroMQ's authentication protocol, RFC 27) that names every connection a
data-plane receiver accepts, and refuses (and counts) the ones it must not.

libzmq asks the handler bound at ``inproc://zeromq.zap.01`` of a socket's context about
every new connection to a socket that has a ZAP domain (``zap_domain``; for CURVE servers
always); the answer decides the handshake, and its user id travels with every message of
that connection (``frame.get("User-Id")``). A receiver registers a :class:`Gate` under a
domain of its own; one handler thread per context answers for all of them:

- CURVE with an authorised directory: a key listed there is admitted under its file's
  name (``rank2.key`` -> ``rank2``: the name is tied to the key); any other is refused.
- otherwise (NULL, or CURVE without a list): every connection is admitted under a fresh
  name (``conn17``), so the receiver can bind the first sender name the connection claims
  to it (:mod:`planes.identity`).

Keys are loaded once from the authorised directory's ``*.key`` files (``dvla keys``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Callable

import zmq
import zmq.auth
from zmq.utils import z85

from planes.config import DataPlaneConfigError

log = logging.getLogger("dvla.planes.data")
_ENDPOINT = "inproc://zeromq.zap.01"
CONNECTION_PREFIX = "conn"  # user ids of connections not tied to a key


def load_public_keys(directory: str | Path) -> dict[bytes, str]:
    """The z85 public keys of the ``*.key`` files in ``directory``, each with its file's
    name (``rank2.key`` -> ``rank2``). Read where it is used (a learner's receiver), so
    hosts that only send need not have it. A missing or empty directory is an error: it
    would refuse every rank."""
    files = sorted(Path(directory).glob("*.key")) if Path(directory).is_dir() else []
    if not files:
        raise DataPlaneConfigError(f"data_plane.curve_authorized_dir: no public keys (*.key) in {directory}; "
                                   f"make them with `dvla keys DIR --ranks N` and use DIR/public")
    keys = {}
    for path in files:
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise DataPlaneConfigError(f"data_plane.curve_authorized_dir: cannot read {path}: {exc}") from None
        if path.stem.startswith(CONNECTION_PREFIX):
            raise DataPlaneConfigError(f"data_plane.curve_authorized_dir: {path}: a key's name must not start "
                                       f"with {CONNECTION_PREFIX!r}")
        keys[public] = path.stem
    return keys


class Gate:
    """One receiver's admission rule (see the module docstring)."""

    _ids = itertools.count()

    def __init__(self, keys: dict[bytes, str] | None = None, on_refused: Callable[[], None] = lambda: None):
        """``keys``: admitted z85 public key -> name (None: admit every connection);
        ``on_refused()`` is called on the handler's thread for every refused client."""
        self.keys, self.on_refused = keys, on_refused

    def answer(self, mechanism: bytes, credentials: list[bytes]) -> tuple[bytes, bytes, bytes]:
        """``(status, text, user id)``."""
        if self.keys is None:
            return b"200", b"OK", f"{CONNECTION_PREFIX}{next(self._ids)}".encode()
        if mechanism != b"CURVE" or not credentials:
            self.on_refused()
            return b"400", b"expected a CURVE request", b""
        name = self.keys.get(z85.encode(credentials[0]))
        if name is None:
            self.on_refused()
            return b"400", b"client key not authorised", b""
        return b"200", b"OK", name.encode()


class ZapHandler:
    """The handler of one context, shared by its receivers (one domain each)."""

    _lock = threading.Lock()
    _by_context: dict[int, ZapHandler] = {}

    @classmethod
    def attach(cls, ctx: zmq.Context, domain: bytes, gate: Gate) -> ZapHandler:
        with cls._lock:
            handler = cls._by_context.get(id(ctx))
            if handler is None:
                handler = cls._by_context[id(ctx)] = cls(ctx)
            handler.gates[domain] = gate
            return handler

    def detach(self, domain: bytes) -> None:
        with self._lock:
            self.gates.pop(domain, None)
            if self.gates:
                return
            self._by_context.pop(id(self.ctx), None)
        self._stop.set()
        self._thread.join(timeout=2)
        # Unbinding an inproc endpoint is synchronous; closing alone frees it only once
        # libzmq's reaper gets to the socket, and a receiver made right after would find
        # the address still in use.
        try:
            self._sock.unbind(_ENDPOINT)
        except zmq.ZMQError:
            pass
        self._sock.close(linger=0)

    def __init__(self, ctx: zmq.Context):
        self.ctx = ctx
        self.gates: dict[bytes, Gate] = {}
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        deadline = time.monotonic() + 5
        while True:  # before any socket with a ZAP domain binds
            try:
                self._sock.bind(_ENDPOINT)
                break
            except zmq.ZMQError as exc:  # a handler just closed: its endpoint is freed asynchronously
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    self._sock.close(linger=0)
                    raise
                time.sleep(0.01)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dvla-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self._sock.recv_multipart()
            self._sock.send_multipart(self._answer(frames))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        # version, request id, domain, address, routing id, mechanism, credentials...
        version, request_id = (frames + [b"", b""])[:2]
        gate = self.gates.get(frames[2]) if len(frames) >= 6 and version == b"1.0" else None
        if gate is None:
            return [b"1.0", request_id, b"400", b"unknown domain", b"", b""]
        status, text, user = gate.answer(frames[5], frames[6:])
        return [b"1.0", request_id, status, text, user, b""]


KEYS_FIX = ("make keys with `dvla keys DIR --ranks N` (DIR shared by the hosts) and set data_plane.curve=true "
            "data_plane.curve_keys_dir=DIR data_plane.curve_authorized_dir=DIR/public")
"""What a job without keys on tcp needs, as the warning and the refusals say it."""


def refuse_or_warn_unauthenticated(require_auth: bool, bind_host: str, loopback: bool) -> None:
    """A receiver is about to listen on tcp and admit any key: refused with
    ``data_plane.require_auth``, else one warning. On a loopback address too: any process
    of any user on the host can reach a tcp port there (an ipc socket in a 0700 directory
    only this user's)."""
    fix = KEYS_FIX
    if require_auth:
        raise DataPlaneConfigError(f"data_plane.require_auth: the data plane would listen on tcp {bind_host} "
                                   f"without authentication; {fix}")
    who = ("any process of any user on this host" if loopback else "any process that reaches this address")
    log.warning("data plane: UNAUTHENTICATED: listening on tcp %s without data_plane.curve_authorized_dir: "
                "%s can connect, send chunks that will be trained on, and claim the name of any rank that "
                "has not connected yet; to admit only your ranks, %s (data_plane.require_auth=true refuses to "
                "start without them)%s", bind_host, who, fix,
                "; on one host, data_plane.transport=ipc listens on no port at all" if loopback else "")
