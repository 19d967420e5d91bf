"""Who sent a message, as the receiver knows it: from the connection, never from the
envelope.

Every connection to a receiver's sockets has a user id from the ZAP handler
(:mod:`planes.zap`): the name of its CurveZMQ key where the receiver lists keys, else a
fresh ``conn<N>``. A keyed connection may only claim its key's name. An unkeyed one is
bound to the first name it claims, which it can never change, and a name already bound to
another connection of the same socket cannot be claimed again. Heartbeats, ``end`` and
counts therefore only ever change the records of the peer that sent them; counts must
also be plausible: a message's ``seq`` only grows, and neither it nor a heartbeat's
``sent`` may run more than ``max_in_flight`` ahead of what arrived from that sender (the
receiver sets it to :data:`MIN_IN_FLIGHT` plus twice the messages the queues between them
can hold: ``send_hwm + recv_hwm + recv_queue``).
A receiver that knows its job's senders (``senders``: the rollout ranks the plan routes to
it) admits no other name at all: a message or heartbeat under any other name is rejected
(:data:`UNKNOWN`) before it is bound or recorded, so a stray or hostile connection can
never own a record, claim counts or be declared dead.
Rejections are ``(reason, detail)``; the receiver counts them by reason.
"""

from __future__ import annotations

import collections
import logging

import zmq

from planes.zap import CONNECTION_PREFIX

log = logging.getLogger("dvla.planes.data")

MIN_IN_FLIGHT = 1024
"""Messages a sender may have sent beyond what arrived, whatever the queues (the kernel's
socket buffers hold some too)."""
SPOOFED = "spoofed_sender"
IMPLAUSIBLE = "implausible_count"
UNAUTHENTICATED = "unauthenticated"
UNKNOWN = "unknown_sender"


class Bindings:
    """One socket's connections and the names they claimed."""

    def __init__(self) -> None:
        self.name_of: dict[str, str] = {}  # connection (user id) -> name
        self.owner_of: dict[str, str] = {}  # name -> connection

    def check(self, user: str, claimed: str) -> tuple[str, str] | None:
        if not user:
            return UNAUTHENTICATED, f"a message claiming {claimed!r} came on a connection without a user id"
        if not user.startswith(CONNECTION_PREFIX):  # tied to a listed key
            if claimed != user:
                return SPOOFED, f"the connection of key {user!r} claims to be {claimed!r}"
            self.name_of[user] = self.owner_of[user] = user
            return None
        bound = self.name_of.get(user)
        if bound is None:
            owner = self.owner_of.get(claimed)
            if owner is not None:
                return SPOOFED, f"{user} claims {claimed!r}, which {owner} already is"
            self.name_of[user], self.owner_of[claimed] = claimed, user
            return None
        if bound != claimed:
            return SPOOFED, f"{user}, bound to {bound!r}, claims to be {claimed!r}"
        return None


class PeerRecords:
    """Per sender name: when last heard, declared dead, messages it has sent (as far as this
    receiver can believe), data messages received and the last ``seq``. The caller holds
    the receiver's lock."""

    def __init__(self, max_in_flight: int, senders=None):
        """``senders``: the only names admitted (None: any)."""
        self.max_in_flight = max_in_flight
        self.senders = None if senders is None else frozenset(senders)
        self.data, self.heartbeats = Bindings(), Bindings()
        self.seen: dict[str, float] = {}
        self.dead: dict[str, float] = {}
        self.sent: dict[str, int] = {}
        self.received: collections.Counter = collections.Counter()
        self.last_seq: dict[str, int] = {}
        # Messages that arrived on each data connection, rejected ones included: a sender's
        # counts may run ahead of these by at most max_in_flight.
        self.arrived: collections.Counter = collections.Counter()

    def admit(self, *, on_heartbeats: bool, heartbeat: bool, user: str, sender: str, seq: int, sent,
              now: float) -> tuple[str, str] | None:
        """Record one decoded message, or say why it is rejected (nothing recorded then).
        ``on_heartbeats``: it came on the heartbeat socket; ``heartbeat``: its kind."""
        if self.senders is not None and sender not in self.senders:
            return UNKNOWN, (f"{user or 'a connection'} claims to be {sender[:40]!r}, which is not a sender of this "
                             f"job ({', '.join(sorted(self.senders)) or 'none'})")
        bad = (self.heartbeats if on_heartbeats else self.data).check(user, sender)
        if bad is not None:
            return bad
        # Data messages it may have sent: what arrived on its data connection, and what may be
        # on the way.
        ceiling = self.arrived[self.data.owner_of.get(sender, "")] + self.max_in_flight
        if heartbeat:
            if not isinstance(sent, int) or not 0 <= sent <= ceiling:
                return IMPLAUSIBLE, (f"heartbeat of {sender} reports sent={sent!r}, {ceiling - self.max_in_flight} "
                                     f"arrived (at most {self.max_in_flight} in flight)")
        else:
            if seq <= self.last_seq.get(sender, -1) or seq >= ceiling:
                return IMPLAUSIBLE, (f"{sender} sent seq={seq} after seq={self.last_seq.get(sender, -1)}, with "
                                     f"{ceiling - self.max_in_flight} arrived (at most {self.max_in_flight} in flight)")
            self.last_seq[sender] = seq
            self.received[sender] += 1
            sent = seq + 1
        if sender in self.dead:
            log.warning("data plane: sender %s is alive again", sender)
            del self.dead[sender]
        self.seen[sender] = now
        if sent > self.sent.get(sender, 0):
            self.sent[sender] = sent
        return None

    def expire(self, now: float, timeout_s: float) -> None:
        for peer, seen in list(self.seen.items()):
            if now - seen > timeout_s:
                del self.seen[peer]
                self.dead[peer] = now
                log.error("data plane: sender %s silent for %.1fs, declared dead", peer, now - seen)


def user_id(frame: zmq.Frame) -> str:
    """The ZAP handler's name of the connection ``frame`` came on ("" if it has none)."""
    try:
        return frame.get("User-Id") or ""
    except zmq.ZMQError:
        return ""
