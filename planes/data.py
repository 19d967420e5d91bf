"""The data plane: trajectory chunks from rollout ranks to a learner over ZeroMQ.

Pattern: **PUSH -> PULL**. Senders (rollout ranks) connect PUSH sockets to the learner's
bound PULL socket. PUSH/PULL is a pipeline: fan-in from any number of senders with fair
queueing, no reply round trip on the hot path, and backpressure for free: when the
learner stops reading, its receive high-water mark fills, then each sender's send
high-water mark, and then ``send`` blocks (up to ``send_timeout_s``) instead of growing
memory. Liveness does not need a reply path either: every sender also sends small
heartbeats from a second PUSH socket to a second receiver socket, which the receiver
keeps reading while it deliberately leaves the data socket unread (backpressure), so a
slow learner never mistakes a blocked sender for a dead one. A sender is declared dead
when nothing has been heard from it for ``peer_timeout_s``.

Addresses are not configured by hand: the receiver binds ``ipc://`` endpoints in a fresh
directory of mode 0700 (only the job's user can reach them) and, only where some sender runs
on another host (or ``transport=tcp``), a ``tcp://`` endpoint (random port, on the address
that routes to the rendezvous host: :mod:`planes.addresses`); it publishes them, with its
host name, in the torch.distributed store that torchrun already runs. A sender on the same
host uses ipc, others tcp. A tcp endpoint without listed keys starts with one warning
(``require_auth`` refuses it).

A sender's name is taken from its connection, never from the envelope
(:mod:`planes.identity`): every connection is named by the receiver's ZAP handler
(:mod:`planes.zap`: its CurveZMQ key's name where keys are listed, else a fresh id bound to
the first name it claims), so heartbeats, ``end`` and counts only change the records of the
peer that sent them, and counts must be plausible.

Who reads the data socket: the consumer's own thread while it waits in ``get`` (no hand-off
between threads per message when the learner keeps up), and a background thread while the
consumer is busy elsewhere (it prefetches and decodes up to ``recv_queue`` messages, so a
learner that returns from an update finds its next chunks ready). A lock gives the socket
to one of them at a time.

Messages use :mod:`planes.serial` (msgpack envelope, one packed frame for the small
tensors, one raw frame per large tensor, never pickle). The receiver validates the
envelope before it reads any data frame, so it knows each frame's size: large tensors
(>= 64 KiB) stay in their ZeroMQ frames (zero-copy, read-only), the packed frame is
received with ``recv_into`` into one fresh buffer per message (writable, owned by that
message's tensors). A frame of another size than declared, or
a missing or extra frame, rejects the message and the rest of its parts are dropped.
Malformed messages are counted by reason and logged; the receiver keeps running.
Optional CurveZMQ encryption (``curve=True``): the receiver's public key travels
through the store; with ``curve_authorized_dir`` only clients whose public keys are
in that directory (``*.key`` files from ``zmq.auth.create_certificates``) may connect.
"""

from __future__ import annotations

from planes.config import DataPlaneConfig
from planes.receiver import TrajectoryReceiver
from planes.sender import TrajectorySender
from planes.transport import (
    HEARTBEAT_KIND,
    BackpressureTimeout,
    Counters,
    Message,
    keep_freed_memory_for_reuse,
    lookup_endpoints,
    remove_stale_ipc_files,
)

__all__ = ["HEARTBEAT_KIND", "BackpressureTimeout", "Counters", "DataPlaneConfig", "Message", "TrajectoryReceiver",
           "TrajectorySender", "keep_freed_memory_for_reuse", "lookup_endpoints", "remove_stale_ipc_files"]
