"""A ZAP handler (ZeroMQ's authentication protocol, RFC 27) that admits CurveZMQ clients
whose public key is listed, and counts the ones it refuses.

libzmq asks the handler bound at ``inproc://zeromq.zap.01`` of a socket's context about
every new connection to a ``curve_server`` socket; the answer decides the handshake. This
one runs on a plain thread with blocking sockets: one request at a time, keys loaded once
from the authorised directory's ``*.key`` files (``dvla keys`` writes them).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import zmq
import zmq.auth
from zmq.utils import z85

from planes.config import DataPlaneConfigError

_ENDPOINT = "inproc://zeromq.zap.01"


def load_public_keys(directory: str | Path) -> set[bytes]:
    """The z85 public keys of the ``*.key`` files in ``directory``. Read where it is used
    (a learner's receiver), so hosts that only send need not have it. A missing or empty
    directory is an error: it would refuse every rank."""
    files = sorted(Path(directory).glob("*.key")) if Path(directory).is_dir() else []
    if not files:
        raise DataPlaneConfigError(f"data_plane.curve_authorized_dir: no public keys (*.key) in {directory}; "
                                   f"make them with `dvla keys DIR --ranks N` and use DIR/public")
    keys = set()
    for path in files:
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise DataPlaneConfigError(f"data_plane.curve_authorized_dir: cannot read {path}: {exc}") from None
        keys.add(public)
    return keys


class CurveAllowList:
    def __init__(self, ctx: zmq.Context, directory: str | Path, on_refused: Callable[[], None] = lambda: None):
        """``on_refused()`` is called (on the handler's thread) for every refused client."""
        self.keys = load_public_keys(directory)
        self.on_refused = on_refused
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(_ENDPOINT)  # before any curve_server socket binds
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
        # version, request id, domain, address, identity, mechanism, credentials...
        version, request_id = (frames + [b"", b""])[:2]
        if len(frames) < 7 or version != b"1.0" or frames[5] != b"CURVE":
            self.on_refused()
            return [b"1.0", request_id, b"400", b"expected a CURVE request", b"", b""]
        key = z85.encode(frames[6])
        if key not in self.keys:
            self.on_refused()
            return [b"1.0", request_id, b"400", b"client key not authorised", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", key, b""]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
