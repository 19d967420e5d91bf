"""The rollout end of the data plane (see :mod:`planes.data`)."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

import zmq
from torch import Tensor

from planes.config import DataPlaneConfig, check
from planes.serial import (
    encode,
)
from planes.transport import _SNDMORE, HEARTBEAT_KIND, BackpressureTimeout, Counters, _hostname

log = logging.getLogger("dvla.planes.data")


class TrajectorySender:
    """Rollout side: connects to a receiver, sends zero-copy, heartbeats in the background."""

    def __init__(self, endpoints: dict[str, str], cfg: DataPlaneConfig | None = None, *,
                 sender_id: str | None = None, ctx: zmq.Context | None = None,
                 client_keys: tuple[bytes, bytes] | None = None):
        self.cfg = cfg or DataPlaneConfig()
        check(self.cfg)
        self.ctx = ctx or zmq.Context.instance()
        self.sender_id = sender_id or f"{_hostname()}:{os.getpid()}"
        self.counters = Counters()
        self.seq = 0
        self.address = self._pick(endpoints, "")
        self._pending: collections.deque = collections.deque()
        self._data = self._socket(endpoints, self.address, self.cfg.send_hwm, client_keys)
        self._data.setsockopt(zmq.SNDTIMEO, int(self.cfg.send_timeout_s * 1000))
        self._hb = self._socket(endpoints, self._pick(endpoints, "hb_"), 4, client_keys)
        self._hb_lock = threading.Lock()
        self._stop = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeat, name="dvla-data-hb", daemon=True)
        self._hb_thread.start()

    def _pick(self, endpoints: dict[str, str], prefix: str) -> str:
        same_host = endpoints.get("host") == _hostname()
        want = self.cfg.transport
        if want == "ipc" or (want == "auto" and same_host and prefix + "ipc" in endpoints):
            if prefix + "ipc" not in endpoints:
                raise ValueError(f"data plane: receiver has no {prefix}ipc endpoint")
            return endpoints[prefix + "ipc"]
        if prefix + "tcp" not in endpoints:
            raise ValueError(f"data plane: receiver has no {prefix}tcp endpoint")
        return endpoints[prefix + "tcp"]

    def _socket(self, endpoints, address: str, hwm: int, client_keys):
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.LINGER, 2000)
        if "curve_public_key" in endpoints:
            public, secret = client_keys or zmq.curve_keypair()
            sock.curve_publickey = public
            sock.curve_secretkey = secret
            sock.curve_serverkey = endpoints["curve_public_key"].encode()
        sock.connect(address)
        return sock

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_s):
            # ``sent``: messages handed to ZeroMQ so far, so the receiver knows what a sender
            # that dies had sent, including what never arrived.
            frames = encode(HEARTBEAT_KIND, {}, {"sender": self.sender_id, "seq": -1, "sent": self.seq})
            try:
                with self._hb_lock:
                    self._hb.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the receiver is gone or slow: it will notice our silence

    def send(self, kind: str, tensors: dict[str, Tensor], meta: dict[str, Any] | None = None,
             on_done: Callable[[], None] | None = None) -> int:
        """Queue one message without copying tensor memory; returns its sequence number.

        Blocks while the receiver applies backpressure, at most ``send_timeout_s``.
        ``on_done`` is called (on a later ``send``, ``flush`` or ``close``) once ZeroMQ no
        longer reads the tensors' memory, or right away if nothing was sent zero-copy."""
        self._reap()
        meta = dict(meta or {})
        seq = self.seq
        meta.update(sender=self.sender_id, seq=seq)
        # Large tensors' frames go zero-copy; the small ones' frames are copies. ZeroMQ is
        # done with a zero-copy frame when pyzmq drops its last reference to the frame's
        # memoryview (pyzmq holds it until libzmq frees the message), so a weak reference
        # per frame tells when: cheaper than a MessageTracker, which builds a
        # threading.Event per frame. The memoryviews keep the tensors' memory alive.
        frames = encode(kind, tensors, meta)
        zero_copy = [weakref.ref(f) for f in frames if type(f) is memoryview]
        try:  # blocks inside libzmq (GIL released) while the receiver applies backpressure
            for f in frames[:-1]:  # send_multipart, without its per-frame type checks and flag enums
                self._data.send(f, _SNDMORE, copy=False)
            self._data.send(frames[-1], 0, copy=False)
        except zmq.Again:
            self.counters.dropped["backpressure_timeout"] += 1
            raise BackpressureTimeout(
                f"data plane: receiver at {self.address} took nothing for {self.cfg.send_timeout_s}s"
            ) from None
        del frames
        if zero_copy:
            self._pending.append((zero_copy, on_done))
        elif on_done is not None:
            on_done()
        self.seq += 1
        self.counters.sent += 1
        return seq

    @staticmethod
    def _released(refs: list[weakref.ref]) -> bool:
        return all(r() is None for r in refs)

    def _reap(self) -> None:
        while self._pending and self._released(self._pending[0][0]):
            self._done(self._pending.popleft())

    @staticmethod
    def _done(entry) -> None:
        if entry[1] is not None:
            entry[1]()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until ZeroMQ no longer needs any tensor passed to ``send``; raises
        ``zmq.NotDone`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._pending:
            if self._released(self._pending[0][0]):
                self._done(self._pending.popleft())
            elif time.monotonic() > deadline:
                raise zmq.NotDone(f"data plane: ZeroMQ still holds {len(self._pending)} messages' tensors")
            else:
                time.sleep(0.0005)

    def close(self) -> None:
        self._stop.set()
        self._hb_thread.join(timeout=5)
        try:
            self.flush(timeout_s=5)
        except zmq.NotDone:
            pass
        self._data.close()
        self._hb.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
