"""The learner end of the data plane (see :mod:`planes.data`)."""

from __future__ import annotations

import logging
import math
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid

import msgpack
import numpy
import zmq
from torch import Tensor

from planes.addresses import endpoint_hosts, is_loopback
from planes.config import DataPlaneConfig, check
from planes.identity import MIN_IN_FLIGHT, PeerRecords, user_id
from planes.zap import Gate, ZapHandler, load_public_keys, refuse_or_warn_unauthenticated

_ENVELOPE_SLACK = 64 << 10  # a message's envelope (names, dtypes, shapes, meta) fits in this
from planes.serial import (
    MessageError,
    as_tensor,
    check_frame,
    check_packed,
    decode_head,
)
from planes.transport import (
    _DISCARD,
    _PREFETCH_AFTER_S,
    _RECV_WAIT_MS,
    HEARTBEAT_KIND,
    Counters,
    Message,
    _hostname,
    keep_freed_memory_for_reuse,
    remove_stale_ipc_files,
)

log = logging.getLogger("dvla.planes.data")


class TrajectoryReceiver:
    """Learner side: binds and publishes its address. A consumer waiting in :meth:`get`
    receives and decodes in its own thread; while it is busy elsewhere, a background thread
    prefetches into the bounded receive queue. The background thread also reads
    heartbeats and tracks liveness throughout."""

    def __init__(self, cfg: DataPlaneConfig | None = None, *, store=None, key: str = "dvla/data/0",
                 ctx: zmq.Context | None = None, peers_elsewhere: bool = False, rendezvous: str | None = None,
                 senders=None):
        """``senders``: the names of the job's senders to this receiver; messages under any
        other name are rejected and counted (:mod:`planes.identity`; None admits any name).
        ``peers_elsewhere``: senders on other hosts will dial the tcp endpoint;
        ``rendezvous``: the host every rank reaches (``MASTER_ADDR``). With them,
        ``cfg.bind_host``/``advertise_host`` resolve (:func:`planes.addresses.endpoint_hosts`)."""
        self.cfg = cfg or DataPlaneConfig()
        check(self.cfg)
        self.bind_host, self.advertise_host = endpoint_hosts(self.cfg.bind_host, self.cfg.advertise_host,
                                                             peers_elsewhere=peers_elsewhere, rendezvous=rendezvous)
        # tcp only where some sender is on another host (or asked for): on one host the
        # ipc directory's mode keeps other users out, and no port is open at all.
        self._tcp = self.cfg.transport == "tcp" or (self.cfg.transport == "auto" and peers_elsewhere)
        self._ipc = self.cfg.transport in ("auto", "ipc")
        if self._tcp and not self.cfg.curve_authorized_dir:
            refuse_or_warn_unauthenticated(self.cfg.require_auth, self.bind_host, is_loopback(self.bind_host))
        if self.cfg.keep_receive_buffers:
            keep_freed_memory_for_reuse()
        self.ctx = ctx or zmq.Context.instance()
        self.counters = Counters()
        # The bounded receive queue, built from two C-implemented queues (queue.Queue's
        # Python-level locking costs several times more per message): decoded messages,
        # and one token per free slot, taken by the receiver thread before it receives.
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._room: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(self.cfg.recv_queue):
            self._room.put(None)
        # Who sent what, bound to connections; counts may run ahead of arrivals by what the
        # queues between a sender and this receiver can hold, and a margin for the kernel's.
        queues = self.cfg.send_hwm + self.cfg.recv_hwm + self.cfg.recv_queue
        self.peers = PeerRecords(MIN_IN_FLIGHT + 2 * queues, senders)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.public_key = None
        keys = None
        if self.cfg.curve:
            public, self._secret = zmq.curve_keypair()
            self.public_key = public
            if self.cfg.curve_authorized_dir:  # refusals are counted as rejected "curve_auth"
                keys = load_public_keys(self.cfg.curve_authorized_dir)
        # Every connection is named by the ZAP handler (its key's name, or a fresh one).
        self._zap_domain = f"dvla-{uuid.uuid4().hex}".encode()
        self._zap = ZapHandler.attach(self.ctx, self._zap_domain, Gate(keys, on_refused=self._refused))
        self.endpoints: dict[str, str] = {"host": _hostname()}
        self._ipc_dir: str | None = None
        if self._ipc:
            remove_stale_ipc_files()
            # mkdtemp: mode 0700, so only this user can reach the sockets inside.
            self._ipc_dir = tempfile.mkdtemp(prefix=f"dvla-{os.getpid()}-")
        # Data and heartbeats arrive on separate sockets so that liveness is still seen
        # while the data socket is deliberately left unread (backpressure).
        self._sock = self._bind("", self.cfg.recv_hwm)
        self._sock.setsockopt(zmq.RCVTIMEO, _RECV_WAIT_MS)
        self._rcvtimeo = _RECV_WAIT_MS
        # The data socket is read by one thread at a time: the consumer while it waits in
        # get(), the background thread (prefetching) while the consumer is busy elsewhere.
        self._sock_lock = threading.Lock()
        self._getting = 0  # consumer threads in get()
        self._left_get = 0.0  # when one last left it (time.monotonic())
        self._hb_sock = self._bind("hb_", 64)
        if self.public_key is not None:
            self.endpoints["curve_public_key"] = self.public_key.decode()
        log.info("data plane: receiving on %s%s", ", ".join(v for k, v in self.endpoints.items() if "://" in v),
                 " (ipc directory mode 0700)" if self._ipc else "")
        if store is not None:
            store.set(key, msgpack.packb(self.endpoints))
        self._thread = threading.Thread(target=self._run, name="dvla-data-recv", daemon=True)
        self._thread.start()

    def _bind(self, prefix: str, hwm: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PULL)
        # Measured with libzmq 4.3.5: behind a ZAP handler (every socket here) a receive HWM
        # of 1 delivers nothing at all (the handshake succeeds, every message stays queued).
        hwm = max(hwm, 2)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.LINGER, 0)
        # Per frame: a bigger one drops the connection before libzmq buffers it. Heartbeats
        # are a few hundred bytes.
        frame = (self.cfg.max_frame_bytes or self.cfg.max_message_bytes) + _ENVELOPE_SLACK
        sock.setsockopt(zmq.MAXMSGSIZE, frame if prefix == "" else _ENVELOPE_SLACK)
        sock.zap_domain = self._zap_domain
        if self.public_key is not None:
            sock.curve_secretkey = self._secret
            sock.curve_publickey = self.public_key
            sock.curve_server = True
        if self._ipc:
            path = os.path.join(self._ipc_dir, f"{prefix.rstrip('_') or 'data'}.sock")
            sock.bind(f"ipc://{path}")
            self.endpoints[prefix + "ipc"] = f"ipc://{path}"
        if self._tcp:
            port = sock.bind_to_random_port(f"tcp://{self.bind_host}")
            self.endpoints[prefix + "tcp"] = f"tcp://{self.advertise_host}:{port}"
        return sock

    # -- background thread ---------------------------------------------------------------
    def _run(self) -> None:
        room = False  # holds a free slot of the receive queue
        next_check = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_check:
                    self._drain_heartbeats()
                    self._check_peers()
                    next_check = now + 0.05
                # Prefetch only while the consumer is busy elsewhere: a consumer that waits in
                # get() receives for itself, which spares a thread hand-off per message.
                if self._getting:
                    self._stop.wait(0.05)
                    continue
                idle = now - self._left_get
                if idle < _PREFETCH_AFTER_S:
                    self._stop.wait(_PREFETCH_AFTER_S - idle)
                    continue
                if not room:
                    try:  # wakes as soon as the consumer takes a message
                        self._room.get(timeout=0.02)
                        room = True
                    except queue.Empty:
                        continue  # backpressure: the data socket stays unread, liveness is still checked
                if not self._sock_lock.acquire(timeout=0.02):
                    continue  # the consumer is receiving
                try:
                    msg = self._receive_data(_RECV_WAIT_MS)
                finally:
                    self._sock_lock.release()
                if msg is not None:
                    self.counters.prefetched += 1
                    self._queue.put(msg)
                    room = False
        except BaseException as exc:  # surfaced to the consumer by get()
            if not self._stop.is_set():
                self._error = exc
                log.exception("data plane receiver failed")

    def _refused(self) -> None:
        with self._lock:  # counters are also written by the data and heartbeat paths
            self.counters.rejected["curve_auth"] += 1
            n = self.counters.rejected["curve_auth"]
        if n <= 5 or n % 1000 == 0:  # a peer that keeps reconnecting must not flood the log
            log.warning("data plane: refused a client whose key is not in %s (%d so far)",
                        self.cfg.curve_authorized_dir, n)

    def _receive_data(self, wait_ms: int) -> Message | None:
        """One message from the data socket, waiting at most ``wait_ms``; the caller holds
        ``_sock_lock``. None when none came or it was rejected."""
        if wait_ms != self._rcvtimeo:
            self._sock.setsockopt(zmq.RCVTIMEO, wait_ms)
            self._rcvtimeo = wait_ms
        # A blocking receive (at most wait_ms, then zmq.Again): libzmq waits for a whole
        # message itself. Polling first woke the thread ~3.5 times per 3 MB message on tcp
        # (libzmq's internal commands signal the socket too), each wake-up a trip through
        # Python. But asking EVENTS first still matters: it makes libzmq process its
        # pending commands, among them "this sender's pipe has data again". A receive that
        # finds a message waiting returns it without processing them (it does so once per
        # 100 messages), and meanwhile fair queueing only rotates over the senders it knows
        # to have data: under backpressure one sender was starved for seconds.
        self._sock.getsockopt(zmq.EVENTS)
        try:
            return self._receive(self._sock, zmq.NOBLOCK if wait_ms == 0 else 0)
        except zmq.Again:
            return None

    def _drain_heartbeats(self) -> None:
        while True:
            try:
                self._receive(self._hb_sock)
            except zmq.Again:
                return

    def _receive(self, sock: zmq.Socket, flags: int = zmq.NOBLOCK) -> Message | None:
        """Receive and decode the next message; raises ``zmq.Again`` when none is waiting
        (``flags=0``: none came within the socket's ``RCVTIMEO``).

        The envelope is checked before any data frame is read, so each frame's size is
        known: the packed frame of small tensors is received straight into one fresh
        buffer (writable, owned by this message's tensors), large tensors are taken
        zero-copy from ZeroMQ."""
        head = sock.recv(flags=flags, copy=False)
        more = head.more
        user = user_id(head)  # the connection's name (planes.identity)
        if sock is self._sock:  # one reader at a time (_sock_lock)
            self.peers.arrived[user] += 1
        try:
            kind, meta, (specs, packed_size, offsets, _) = decode_head(head.buffer, self.cfg.max_message_bytes)
            out: list[Tensor | None] = [None] * len(specs)
            if packed_size is not None:
                if not more:
                    raise MessageError("bad_frames", "the packed frame of small tensors is missing")
                # Not zero-filled: its pages cost nothing until the frame is received into
                # them, so an envelope that declares bytes it never sends costs nothing.
                packed = numpy.empty(packed_size, dtype=numpy.uint8)
                # recv_into returns the frame's real size: a larger frame was truncated.
                size = sock.recv_into(packed, flags=zmq.NOBLOCK)  # the parts of a message arrive together
                more = sock.getsockopt(zmq.RCVMORE)
                check_packed(packed_size, size)
                for i, (spec, off) in enumerate(zip(specs, offsets)):
                    if off is not None:
                        out[i] = as_tensor(packed, spec, off)
            for i, (spec, off) in enumerate(zip(specs, offsets)):
                if off is None:
                    if not more:
                        raise MessageError("bad_frames", f"data frame of tensor {i} of {len(specs)} is missing")
                    frame = sock.recv(flags=zmq.NOBLOCK, copy=False)
                    more = frame.more
                    check_frame(spec, len(frame.buffer))
                    out[i] = as_tensor(frame.buffer, spec)
            if more:
                raise MessageError("bad_frames", "more data frames received than the envelope declares")
            tensors = {spec.name: t for spec, t in zip(specs, out)}
            sender, seq = meta.get("sender"), meta.get("seq")
            if not isinstance(sender, str) or not isinstance(seq, int):
                raise MessageError("bad_envelope", "meta must carry 'sender' (str) and 'seq' (int)")
        except MessageError as exc:
            while more:  # drop the rest of the message
                sock.recv_into(_DISCARD, flags=zmq.NOBLOCK)
                more = sock.getsockopt(zmq.RCVMORE)
            self._reject(exc.reason, str(exc), user)
            return None
        with self._lock:
            bad = self.peers.admit(on_heartbeats=sock is self._hb_sock, heartbeat=kind == HEARTBEAT_KIND, user=user,
                                   sender=sender, seq=seq, sent=meta.get("sent"), now=time.monotonic())
        if bad is not None:
            self._reject(*bad, user)
            return None
        if kind == HEARTBEAT_KIND:
            return None
        self.counters.received += 1
        return Message(kind=kind, meta=meta, tensors=tensors, sender=sender, seq=seq)

    def _reject(self, reason: str, detail: str, user: str) -> None:
        with self._lock:  # heartbeats (background thread) and data (either thread) both count here
            self.counters.rejected[reason] += 1
            n = self.counters.rejected[reason]
            name = self.peers.data.name_of.get(user) or self.peers.heartbeats.name_of.get(user)
        if n <= 5 or n % 1000 == 0:  # a peer sending garbage must not flood the log
            who = f"{user or 'an unnamed connection'}" + (f" ({name})" if name and name != user else "")
            log.error("data plane: rejected a message from %s (%s, %d so far): %s", who, reason, n, detail)

    def _check_peers(self) -> None:
        with self._lock:
            self.peers.expire(time.monotonic(), self.cfg.peer_timeout_s)

    # -- consumer API ----------------------------------------------------------------------
    def get(self, timeout: float | None = None) -> Message | None:
        """Next message, or None after ``timeout`` seconds. Re-raises a receiver failure.

        Messages prefetched while the consumer was busy come first; with none waiting, the
        calling thread receives from the socket itself (one thread at a time)."""
        self._raise_if_failed()
        msg = self._take_queued()
        if msg is None and not self._stop.is_set():
            msg = self._get_direct(timeout)
        return msg

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("data plane receiver thread failed") from self._error

    def _take_queued(self) -> Message | None:
        if self._queue.empty():  # the common case when the consumer keeps up: no exception raised
            return None
        try:
            msg = self._queue.get_nowait()
        except queue.Empty:
            return None
        self._room.put(None)
        return msg

    def _get_direct(self, timeout: float | None) -> Message | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._getting += 1
        try:
            while True:
                remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                # The background thread may hold the socket, receiving for up to
                # _RECV_WAIT_MS: what it receives meanwhile lands in the queue.
                if self._sock_lock.acquire(timeout=-1 if remaining is None else remaining):
                    try:
                        msg = self._take_queued()
                        if msg is not None or self._stop.is_set():
                            return msg
                        wait = _RECV_WAIT_MS if remaining is None else min(_RECV_WAIT_MS, math.ceil(remaining * 1000))
                        msg = self._receive_data(wait)
                    finally:
                        self._sock_lock.release()
                else:
                    msg = self._take_queued()
                if msg is not None:
                    return msg
                self._raise_if_failed()
                if deadline is not None and time.monotonic() >= deadline:
                    return None
        finally:
            with self._lock:
                self._getting -= 1
                self._left_get = time.monotonic()

    def depth(self) -> int:
        """Decoded messages waiting for the consumer."""
        return self._queue.qsize()

    @property
    def live_peers(self) -> list[str]:
        with self._lock:
            return sorted(self.peers.seen)

    @property
    def dead_peers(self) -> list[str]:
        with self._lock:
            return sorted(self.peers.dead)

    @property
    def reported_sent(self) -> dict[str, int]:
        """Per sender, the messages it has sent as far as this receiver knows (from its
        heartbeats and the sequence numbers received); more than arrived means some are
        still in flight or were lost."""
        with self._lock:
            return dict(self.peers.sent)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        locked = self._sock_lock.acquire(timeout=5)  # a consumer's receive ends within _RECV_WAIT_MS
        self._sock.close(linger=0)
        if locked:
            self._sock_lock.release()
        self._hb_sock.close(linger=0)
        self._zap.detach(self._zap_domain)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
