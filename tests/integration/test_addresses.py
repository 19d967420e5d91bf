"""Which address a learner binds and advertises (:mod:`planes.addresses`), and which
interface gloo and NCCL are pointed at (:func:`dvla.distributed.select_interfaces`): on
loopback here, and inside two network namespaces that only share a veth link."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dvla.distributed import select_interfaces
from planes.addresses import AddressError, endpoint_hosts, interface_address, interface_of


def test_one_host_binds_and_advertises_loopback():
    assert endpoint_hosts("auto", "auto", peers_elsewhere=False, rendezvous=None) == ("127.0.0.1", "127.0.0.1")
    assert endpoint_hosts("0.0.0.0", "auto", peers_elsewhere=False, rendezvous=None) == ("0.0.0.0", "127.0.0.1")
    assert endpoint_hosts("lo", "auto", peers_elsewhere=False, rendezvous=None) == ("127.0.0.1", "127.0.0.1")
    assert interface_address("lo") == "127.0.0.1" and interface_of("127.0.0.1") == "lo"


def test_ranks_sharing_a_loopback_rendezvous_may_use_loopback():
    """Hosts told apart only by name (``DVLA_FAKE_HOSTNAME``) share one network stack: a
    rendezvous on loopback proves it."""
    assert endpoint_hosts("auto", "auto", peers_elsewhere=True, rendezvous="127.0.0.1") == ("127.0.0.1",) * 2


def test_loopback_told_to_other_hosts_is_an_error():
    with pytest.raises(AddressError, match=r"data_plane.bind_host: this rank would tell ranks on other hosts to "
                                           r"connect to 127.0.0.1 \(loopback\)"):
        endpoint_hosts("127.0.0.1", "auto", peers_elsewhere=True, rendezvous="10.1.2.3")
    with pytest.raises(AddressError, match="no rendezvous host is known"):
        endpoint_hosts("auto", "auto", peers_elsewhere=True, rendezvous=None)
    with pytest.raises(AddressError, match=r"data_plane.bind_host: 'nosuchif0' is neither an IPv4 address nor an "
                                           r"interface of this host"):
        endpoint_hosts("nosuchif0", "auto", peers_elsewhere=False, rendezvous=None)
    with pytest.raises(AddressError, match="data_plane.advertise_host: 'eth9x'"):
        endpoint_hosts("0.0.0.0", "eth9x", peers_elsewhere=False, rendezvous=None)


def test_select_interfaces_leaves_one_host_alone():
    env = {"MASTER_ADDR": "127.0.0.1"}
    assert select_interfaces(env) is None and "GLOO_SOCKET_IFNAME" not in env
    env = {"MASTER_ADDR": "10.9.9.9", "GLOO_SOCKET_IFNAME": "mine"}
    select_interfaces(env)
    assert env["GLOO_SOCKET_IFNAME"] == "mine"  # what the user set wins


_PROBE = """
import json, sys
from dvla.distributed import select_interfaces
from planes.addresses import endpoint_hosts
env = {"MASTER_ADDR": sys.argv[1]}
print(json.dumps({"hosts": endpoint_hosts("auto", "auto", peers_elsewhere=True, rendezvous=sys.argv[1]),
                  "wild": endpoint_hosts("0.0.0.0", "auto", peers_elsewhere=True, rendezvous=sys.argv[1]),
                  "ifname": select_interfaces(env), "env": env}))
"""


@pytest.mark.slow
def test_across_namespaces_the_route_to_the_rendezvous_host_decides(two_hosts):
    a, b = two_hosts.hosts
    for me, rdzv in ((a, b.address), (b, a.address), (a, a.address)):
        got = json.loads(subprocess.run(me.command([sys.executable, "-c", _PROBE, rdzv]), capture_output=True,
                                        text=True, check=True, timeout=60).stdout)
        assert got["hosts"] == [me.address, me.address]  # even when the rendezvous host is itself
        assert got["wild"] == ["0.0.0.0", me.address]
        assert got["ifname"] == me.veth
        assert got["env"]["GLOO_SOCKET_IFNAME"] == got["env"]["NCCL_SOCKET_IFNAME"] == me.veth
