"""Which address a process binds and which one it tells its peers, on a real network.

A learner's data-plane receiver binds a tcp endpoint and publishes its address through the
store; rollout ranks on other hosts dial it. Binding loopback and publishing it works only
while every rank shares one network stack. :func:`endpoint_hosts` turns the configured
``bind_host``/``advertise_host`` into a bind address and an address peers can reach:

- ``auto`` binds loopback when every rank is on this host, and otherwise the local
  address that routes to the rendezvous host (``MASTER_ADDR``): the network the job
  already uses to find itself.
- an interface name (``eth0``) binds that interface's IPv4 address.
- ``0.0.0.0`` binds every interface and advertises the routed address.
- an IPv4 address binds (and advertises) that address.

A loopback address published to peers on other hosts is an error, not a hang.
:func:`interface_of` names the interface that holds an address, so that gloo and NCCL can
be pointed at the same network (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
WILDCARD = "0.0.0.0"


class AddressError(ValueError):
    """No address peers can reach (the message says which setting to change)."""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` (None if it has none or does not exist)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interfaces() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/net"))
    except OSError:
        return [name for _, name in socket.if_nameindex()]


def interface_of(address: str) -> str | None:
    """The interface that holds IPv4 ``address`` (None if no interface of this host does)."""
    for name in interfaces():
        if interface_address(name) == address:
            return name
    return None


def route_to(host: str) -> str:
    """The local IPv4 address the kernel would use to reach ``host`` (no packet is sent:
    connecting a UDP socket only picks a route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def _named(value: str, what: str) -> str:
    """An IPv4 address as given, or the address of the interface so named."""
    try:
        ipaddress.IPv4Address(value)
        return value
    except ValueError:
        pass
    addr = interface_address(value)
    if addr is None:
        raise AddressError(f"{what}: {value!r} is neither an IPv4 address nor an interface of this host with one "
                           f"(interfaces: {', '.join(interfaces())})")
    return addr


def endpoint_hosts(bind_host: str, advertise_host: str, *, peers_elsewhere: bool,
                   rendezvous: str | None, field: str = "data_plane.") -> tuple[str, str]:
    """``(bind, advertise)`` for a tcp endpoint. ``peers_elsewhere``: some rank that dials
    it runs on another host; ``rendezvous``: the host every rank already reaches
    (``MASTER_ADDR``), or None."""

    def routed() -> str:
        if not peers_elsewhere:
            return "127.0.0.1"
        if rendezvous is None:
            raise AddressError(f"{field}bind_host=auto: ranks run on other hosts and no rendezvous host is known "
                               f"(MASTER_ADDR); set {field}bind_host to this host's address or interface")
        try:
            return route_to(rendezvous)
        except OSError as exc:
            raise AddressError(f"{field}bind_host=auto: no route to the rendezvous host {rendezvous!r} ({exc}); "
                               f"set {field}bind_host to this host's address or interface") from None

    if bind_host == "auto":
        bind = routed()
    elif bind_host == WILDCARD:
        bind = WILDCARD
    else:
        bind = _named(bind_host, f"{field}bind_host")
    if advertise_host != "auto":
        advertise = _named(advertise_host, f"{field}advertise_host")
    else:
        advertise = routed() if bind == WILDCARD else bind
    shared_stack = rendezvous is not None and is_loopback(rendezvous)  # every rank reached it on loopback
    if peers_elsewhere and is_loopback(advertise) and not shared_stack:
        raise AddressError(f"{field}bind_host: this rank would tell ranks on other hosts to connect to {advertise} "
                           f"(loopback); set {field}bind_host (or {field}advertise_host) to an address they can reach")
    return bind, advertise
