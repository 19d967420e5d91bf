"""Two "hosts" on one machine that do not share a network stack: Linux network namespaces
joined by a veth pair, each with an address of its own. Used by the multi-host tests;
needs root and iproute2 (``require_two_hosts`` says why not, or fails when
``DVLA_REQUIRE_NETNS=1``, as CI sets it)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from dataclasses import dataclass

import pytest


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 (ip) and util-linux (unshare) are needed"
    probe = f"dvla-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    netns: str
    veth: str
    address: str
    hostname: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host: its network namespace and a UTS namespace whose
        host name is this host's."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostname} && exec "$@"', "sh", *argv]

    def link_bytes(self) -> tuple[int, int]:
        """(received, sent) bytes of this host's end of the veth."""
        info = json.loads(_ip("-n", self.netns, "-j", "-s", "link", "show", "dev", self.veth).stdout)[0]
        return info["stats64"]["rx"]["bytes"], info["stats64"]["tx"]["bytes"]


class TwoHosts:
    """Namespaces ``a`` and ``b`` on 10.250.N.0/24 (N random), removed by :meth:`close`.
    Each resolves both host names, as a cluster's ``/etc/hosts`` would: ``ip netns exec``
    mounts ``/etc/netns/<name>/hosts`` over ``/etc/hosts``."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"
        net = random.randrange(1, 250)
        self.hosts = [Host(f"dvla-{tag}-{x}", f"dv{tag}{x}", f"10.250.{net}.{i + 1}", f"dvla-host-{x}")
                      for i, x in enumerate("ab")]
        self._made: list[str] = []
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.hostname}\n" for h in self.hosts)
        try:
            for h in self.hosts:
                _ip("netns", "add", h.netns)
                self._made.append(h.netns)
                etc = f"/etc/netns/{h.netns}"
                os.makedirs(etc, exist_ok=True)
                with open(f"{etc}/hosts", "w") as f:
                    f.write(hosts_file)
            a, b = self.hosts
            _ip("link", "add", a.veth, "type", "veth", "peer", "name", b.veth)
            for h in self.hosts:
                _ip("link", "set", h.veth, "netns", h.netns)
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.veth)
                _ip("-n", h.netns, "link", "set", h.veth, "up")
                _ip("-n", h.netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for name in self._made:  # deleting a namespace deletes its end of the veth, and the pair
            _ip("netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        self._made = []


def require_two_hosts():
    """A fixture body: TwoHosts, or a skip (a failure under ``DVLA_REQUIRE_NETNS=1``)."""
    why = unavailable()
    if why is not None:
        if os.environ.get("DVLA_REQUIRE_NETNS") == "1":
            pytest.fail(f"DVLA_REQUIRE_NETNS=1 but {why}")
        pytest.skip(why)
    hosts = TwoHosts()
    try:
        yield hosts
    finally:
        hosts.close()
