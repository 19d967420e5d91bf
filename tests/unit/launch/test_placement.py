"""launch.topology and launch.placement: discovery over a real TCPStore, config specs,
nvidia-smi parsing, and the roles/routes/tree that place() derives."""

import json
import os
import sys
import threading
import types
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from launch import topology as topo_mod
from launch.placement import BroadcastTree, Placement, format_placement, place
from launch.gpu_links import parse_nvidia_smi_topo
from launch.topology import HostInfo, Topology, describe, discover, from_spec, local_info

# -- nvidia-smi topo -m samples -------------------------------------------------------------------------

# An 8-GPU NVLink box (hybrid cube mesh, NV1/NV2 between pairs) with two NICs, a header
# wrapped in terminal escapes as nvidia-smi writes it, and the legend.
SMI_8GPU_NVLINK = (
    "\x1b[4m\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tmlx5_0\tmlx5_1\tCPU Affinity\tNUMA Affinity\x1b[0m\n"
    "GPU0\t X \tNV1\tNV1\tNV2\tNV2\tSYS\tSYS\tSYS\tPIX\tSYS\t0-19,40-59\t0\n"
    "GPU1\tNV1\t X \tNV2\tNV1\tSYS\tNV2\tSYS\tSYS\tPIX\tSYS\t0-19,40-59\t0\n"
    "GPU2\tNV1\tNV2\t X \tNV2\tSYS\tSYS\tNV1\tSYS\tPHB\tSYS\t0-19,40-59\t0\n"
    "GPU3\tNV2\tNV1\tNV2\t X \tSYS\tSYS\tSYS\tNV1\tPHB\tSYS\t0-19,40-59\t0\n"
    "GPU4\tNV2\tSYS\tSYS\tSYS\t X \tNV1\tNV1\tNV2\tSYS\tPIX\t20-39,60-79\t1\n"
    "GPU5\tSYS\tNV2\tSYS\tSYS\tNV1\t X \tNV2\tNV1\tSYS\tPIX\t20-39,60-79\t1\n"
    "GPU6\tSYS\tSYS\tNV1\tSYS\tNV1\tNV2\t X \tNV2\tSYS\tPHB\t20-39,60-79\t1\n"
    "GPU7\tSYS\tSYS\tSYS\tNV1\tNV2\tNV1\tNV2\t X \tSYS\tPHB\t20-39,60-79\t1\n"
    "mlx5_0\tPIX\tPIX\tPHB\tPHB\tSYS\tSYS\tSYS\tSYS\t X \tSYS\t\t\n"
    "mlx5_1\tSYS\tSYS\tSYS\tSYS\tPIX\tPIX\tPHB\tPHB\tSYS\t X \t\t\n"
    "\n"
    "Legend:\n\n"
    "  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
    "  PIX  = Connection traversing at most a single PCIe bridge\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n"
)

# A 2-GPU PCIe box, columns padded with spaces instead of tabs.
SMI_2GPU_PCIE = """\
        GPU0    GPU1    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      SYS     0-15            0               N/A
GPU1    SYS      X      16-31           1               N/A

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  GPU0 is here only to confuse a parser that does not stop at the legend
"""


def test_parse_nvidia_smi_topo_8_gpu_nvlink_drops_nics_affinity_and_legend():
    m = parse_nvidia_smi_topo(SMI_8GPU_NVLINK)
    assert len(m) == 8 and all(len(row) == 8 for row in m)
    assert [m[i][i] for i in range(8)] == ["X"] * 8
    assert m[0] == ["X", "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS"]
    assert m[7] == ["SYS", "SYS", "SYS", "NV1", "NV2", "NV1", "NV2", "X"]
    assert all(m[i][j] == m[j][i] for i in range(8) for j in range(8))  # the sample is symmetric
    assert not any(c.startswith(("PIX", "PHB")) for row in m for c in row)  # NIC columns dropped


def test_parse_nvidia_smi_topo_2_gpu_pcie_and_no_gpus():
    assert parse_nvidia_smi_topo(SMI_2GPU_PCIE) == [["X", "SYS"], ["SYS", "X"]]
    assert parse_nvidia_smi_topo("No devices were found\n") == []
    assert parse_nvidia_smi_topo("") == []
    with pytest.raises(ValueError, match="GPU1"):
        parse_nvidia_smi_topo("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\n")


def test_gpu_links_falls_back_to_nvidia_smi_and_respects_visible_devices(tmp_path, monkeypatch):
    exe = tmp_path / "nvidia-smi"
    (tmp_path / "topo.txt").write_text(SMI_8GPU_NVLINK)
    exe.write_text(f"#!/bin/sh\n[ \"$1 $2\" = 'topo -m' ] || exit 3\ncat '{tmp_path / 'topo.txt'}'\n")
    exe.chmod(0o755)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert topo_mod.gpu_links() == parse_nvidia_smi_topo(SMI_8GPU_NVLINK)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,0")
    assert topo_mod.gpu_links() == [["X", "NV2"], ["NV2", "X"]]
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    assert topo_mod.gpu_links() is None


def _fake_pynvml(links: dict[int, list[str]], p2p_nvlink: set, ancestors: dict) -> types.ModuleType:
    """A stand-in for pynvml: GPU i has PCI bus id 'bus{i}' and NVLinks to ``links[i]``."""
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    m.NVMLError = NVMLError
    m.NVML_FEATURE_ENABLED, m.NVML_P2P_STATUS_OK, m.NVML_P2P_CAPS_INDEX_NVLINK = 1, 0, 2
    m.NVML_TOPOLOGY_SYSTEM, m.NVML_TOPOLOGY_NODE, m.NVML_NVLINK_MAX_LINKS = 50, 40, 18
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(links)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"BUS{h}".encode())

    def state(h, link):
        if link >= len(links[h]):
            raise NVMLError("invalid argument")
        return 1

    m.nvmlDeviceGetNvLinkState = state
    m.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, link: types.SimpleNamespace(busId=links[h][link])
    m.nvmlDeviceGetP2PStatus = lambda a, b, idx: 0 if idx == 2 and frozenset((a, b)) in p2p_nvlink else 5
    m.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: ancestors[frozenset((a, b))]
    return m


def test_gpu_links_from_pynvml_direct_links_and_nvswitch(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # GPU0 and GPU1 share two direct NVLinks; GPU2 hangs off PCIe on the other socket.
    fake = _fake_pynvml({0: ["bus1", "bus1"], 1: ["bus0", "bus0"], 2: []}, {frozenset((0, 1))},
                        {frozenset((0, 2)): 50, frozenset((1, 2)): 40, frozenset((0, 1)): 40})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert topo_mod.gpu_links() == [["X", "NV2", "SYS"], ["NV2", "X", "NODE"], ["SYS", "NODE", "X"]]
    # Behind an NVSwitch the far end of every link is the switch, not the other GPU.
    fake = _fake_pynvml({0: ["switch"] * 4, 1: ["switch"] * 4}, {frozenset((0, 1))}, {})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert topo_mod.gpu_links() == [["X", "NV4"], ["NV4", "X"]]


# -- local_info and discover -----------------------------------------------------------------------------

def test_local_info_is_json_and_uses_the_fake_hostname(monkeypatch):
    monkeypatch.setenv("DVLA_FAKE_HOSTNAME", "pretend-host")
    info = local_info(3, 1)
    assert json.loads(json.dumps(info)) == info
    assert info["hostname"] == "pretend-host" and info["rank"] == 3 and info["local_rank"] == 1
    assert info["cpus"] == len(os.sched_getaffinity(0))
    assert info["gpus"] >= 0 and len(info["gpu_names"]) == info["gpus"]
    assert local_info(0, 0, hostname="explicit")["hostname"] == "explicit"


def test_discover_over_a_tcp_store_groups_ranks_into_hosts():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    # rank -> (host, local rank); rank 2 sits on another host between rank 1 and rank 3.
    layout = {0: ("nodeA", 0), 1: ("nodeA", 1), 2: ("nodeB", 0), 3: ("nodeA", 2)}
    results, errors = {}, []

    def rank_main(rank):
        try:
            store = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=20))
            host, local = layout[rank]
            results[rank] = discover(store, rank, len(layout), local, prefix="test/topo", hostname=host)
        except BaseException as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in layout]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(results) == 4
    t0 = results[0]
    assert all(results[r] == t0 for r in layout)  # every rank sees the same topology
    assert t0.n_hosts == 2 and t0.world_size == 4
    assert [h.name for h in t0.hosts] == ["nodeA", "nodeB"]
    assert t0.hosts[0].ranks == [0, 1, 3] and t0.hosts[0].local_ranks == [0, 1, 2]
    assert t0.hosts[1].ranks == [2]
    assert t0.same_host(1, 3) and not t0.same_host(0, 2) and t0.host_of(2) == 1
    assert json.loads(master.get("test/topo/2"))["hostname"] == "nodeB"  # plain JSON in the store
    p = place(t0, 1, colocate=False)
    assert p.transports == {1: "ipc", 2: "tcp", 3: "ipc"}
    assert p.tree.leaders == [0, 2]


def test_discover_rejects_rank_outside_world():
    with pytest.raises(ValueError, match="outside world size"):
        discover(object(), 4, 4)


# -- from_spec, Topology ---------------------------------------------------------------------------------

def test_from_spec_forms():
    t = from_spec("2x4")
    assert t.world_size == 8 and t.n_hosts == 2
    assert [h.ranks for h in t.hosts] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [h.local_ranks for h in t.hosts] == [[0, 1, 2, 3]] * 2
    assert [h.gpus for h in t.hosts] == [0, 0]
    assert [h.gpus for h in from_spec("3X2:8").hosts] == [8, 8, 8]
    u = from_spec([3, 1])
    assert [h.ranks for h in u.hosts] == [[0, 1, 2], [3]] and u.host_of(3) == 1
    assert from_spec(t.to_dict()) == t
    assert from_spec(t) is t


@pytest.mark.parametrize("bad", ["2x", "x4", "0x4", "2x0", "2x4:", "2 by 4", "", [], [2, 0], [2, "a"],
                                 [True, 1], 3.5, None, {"nope": 1}])
def test_from_spec_rejects_bad_specs(bad):
    with pytest.raises(ValueError, match="topology"):
        from_spec(bad)


def test_topology_round_trip_and_validation():
    t = Topology([
        HostInfo("b", [2, 3], [0, 1], gpus=2, gpu_names=["H200", "H200"], cpus=32, numa_nodes=2,
                 gpu_links=[["X", "NV18"], ["NV18", "X"]]),
        HostInfo("a", [0, 1], [0, 1], gpus=2, gpu_names=["H200", "H200"], cpus=32, numa_nodes=2),
    ], 4)
    assert [h.name for h in t.hosts] == ["a", "b"]  # ordered by lowest rank
    back = Topology.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t and back.host_of(3) == 1 and back.hosts[1].gpu_links[0][1] == "NV18"
    text = describe(t)
    assert "2 hosts, 4 ranks" in text and "b: ranks 2-3" in text and "NV18" in text
    with pytest.raises(ValueError, match="no rank 9"):
        t.host_of(9)
    mixed = Topology([HostInfo("a", [3, 0, 2, 1], [1, 0, 3, 2])], 4)
    assert mixed.hosts[0].ranks == [0, 1, 2, 3] and mixed.hosts[0].local_ranks == [0, 2, 3, 1]
    with pytest.raises(ValueError, match="rank 1 is on host"):
        Topology([HostInfo("a", [0, 1], [0, 1]), HostInfo("b", [1], [0])], 2)
    with pytest.raises(ValueError, match="missing \\[2\\]"):
        Topology([HostInfo("a", [0, 1], [0, 1])], 3)


# -- place ---------------------------------------------------------------------------------------------------

def test_single_host():
    p = place(from_spec("1x4"), 1, colocate=False)
    assert p.learners == [0] and p.rollout == [1, 2, 3] and p.source == 0
    assert p.routes == {1: 0, 2: 0, 3: 0} and set(p.transports.values()) == {"ipc"}
    assert p.tree.leaders == [0] and p.tree.local_groups == [[0, 1, 2, 3]] and p.tree.inter_node_copies == 0
    assert [p.role(r) for r in range(4)] == ["learner", "rollout", "rollout", "rollout"]
    assert [p.tree.stage_of(r) for r in range(4)] == ["source", "member", "member", "member"]


def test_single_host_colocated_learners_feed_themselves_then_balance():
    p = place(from_spec("1x4"), 2, colocate=True)
    assert p.learners == [0, 1] and p.rollout == [0, 1, 2, 3]
    assert p.routes == {0: 0, 1: 1, 2: 0, 3: 1}
    assert [p.role(r) for r in range(4)] == ["learner+rollout", "learner+rollout", "rollout", "rollout"]
    assert p.senders_of(0) == [0, 2] and p.senders_of(1) == [1, 3]


def test_two_hosts_of_two():
    t = from_spec("2x2")
    p = place(t, 1, colocate=False)
    assert p.routes == {1: 0, 2: 0, 3: 0}
    assert p.transports == {1: "ipc", 2: "tcp", 3: "tcp"}
    assert p.tree == BroadcastTree(0, [0, 2], [[0, 1], [2, 3]])
    assert p.tree.inter_node_copies == 1
    assert [p.tree.stage_of(r) for r in range(4)] == ["source", "member", "leader", "member"]
    assert [p.tree.leader_of(r) for r in range(4)] == [0, 0, 2, 2]

    p2 = place(t, 2, colocate=False)  # both learners on host0, rollouts spread over them
    assert p2.learners == [0, 1] and p2.routes == {2: 0, 3: 1} and set(p2.transports.values()) == {"tcp"}


def test_learners_spanning_hosts_keep_local_routes():
    p = place(from_spec("2x2"), 3, colocate=False)
    assert p.learners == [0, 1, 2] and p.routes == {3: 2} and p.transports == {3: "ipc"}

    # 3 hosts x 4: learners fill host0 and half of host1; host1's rollouts stay local,
    # host2's go round-robin to the least-loaded learners.
    q = place(from_spec("3x4"), 6, colocate=False)
    assert q.learners == [0, 1, 2, 3, 4, 5]
    assert q.routes == {6: 4, 7: 5, 8: 0, 9: 1, 10: 2, 11: 3}
    assert q.transports == {6: "ipc", 7: "ipc", 8: "tcp", 9: "tcp", 10: "tcp", 11: "tcp"}
    assert q.senders_of(4) == [6] and q.senders_of(0) == [8]
    assert q.tree.leaders == [0, 4, 8] and q.tree.inter_node_copies == 2


def test_uneven_hosts():
    t = from_spec([3, 1])
    p = place(t, 1, colocate=False)
    assert p.routes == {1: 0, 2: 0, 3: 0} and p.transports == {1: "ipc", 2: "ipc", 3: "tcp"}
    assert p.tree.leaders == [0, 3] and p.tree.local_groups == [[0, 1, 2], [3]]
    assert p.tree.stage_of(3) == "leader"
    p2 = place(t, 2, colocate=False)
    assert p2.learners == [0, 1] and p2.routes == {2: 0, 3: 1} and p2.transports == {2: "ipc", 3: "tcp"}


def test_learners_prefer_the_largest_other_hosts():
    # host0 = {0,1}, host1 = {2}, host2 = {3,4,5}: 4 learners fit on 2 hosts (0,1 + 3,4), not 3.
    p = place(from_spec([2, 1, 3]), 4, colocate=False)
    assert p.learners == [0, 1, 3, 4]
    assert p.routes == {2: 0, 5: 3} and p.transports == {2: "tcp", 5: "ipc"}
    assert p.tree.leaders == [0, 2, 3]


def test_colocate_false_all_learners_and_other_errors():
    t = from_spec("2x2")
    with pytest.raises(ValueError, match="no rank is left to run rollouts"):
        place(t, 4, colocate=False)
    p = place(t, 4, colocate=True)
    assert p.rollout == [0, 1, 2, 3] and p.routes == {r: r for r in range(4)}
    assert set(p.transports.values()) == {"ipc"}
    for bad in (0, -1, 5):
        with pytest.raises(ValueError, match="between 1 and the world size 4"):
            place(t, bad, colocate=True)
    with pytest.raises(ValueError, match="integer"):
        place(t, True, colocate=True)
    with pytest.raises(ValueError, match="not a learner"):
        p.senders_of(9)


@pytest.mark.parametrize("spec", ["1x1", "1x8", "2x4", "4x2", [5, 3, 1], [1, 4, 4], [2, 2, 2, 7]])
def test_placement_invariants(spec):
    t = from_spec(spec)
    for n in range(1, t.world_size + 1):
        for colocate in (False, True):
            if n == t.world_size and not colocate:
                continue
            p = place(t, n, colocate)
            assert p.source == 0 and 0 in p.learners and len(p.learners) == n
            assert set(p.rollout) == (set(range(t.world_size)) if colocate
                                      else set(range(t.world_size)) - set(p.learners))
            for r, dst in p.routes.items():
                assert dst in p.learners
                assert p.transports[r] == ("ipc" if t.same_host(r, dst) else "tcp")
                if any(t.same_host(r, ln) for ln in p.learners):
                    assert t.same_host(r, dst), (spec, n, r, dst)
            loads = [len(p.senders_of(ln)) for ln in p.learners]
            if all(not any(t.same_host(r, ln) for ln in p.learners) for r in p.rollout):
                assert max(loads) - min(loads) <= 1  # all remote: evenly spread
            # Learners occupy as few hosts as a count of per-host ranks allows.
            sizes = sorted((len(h.ranks) for h in t.hosts[1:]), reverse=True)
            need, left = 1, n - len(t.hosts[0].ranks)
            for s in sizes:
                if left <= 0:
                    break
                need, left = need + 1, left - s
            assert len({t.host_of(ln) for ln in p.learners}) == need
            assert p.tree.inter_node_copies == t.n_hosts - 1
            assert sorted(p.tree.leaders) == sorted(min(h.ranks) for h in t.hosts)


def test_placement_dict_round_trip_and_check():
    t = from_spec("3x4")
    p = place(t, 5, colocate=True)
    d = json.loads(json.dumps(p.to_dict()))
    assert all(isinstance(k, str) for k in d["routes"])
    assert Placement.from_dict(d) == p
    d["routes"]["7"] = 11  # not a learner
    with pytest.raises(ValueError, match="not a learner"):
        Placement.from_dict(d)


def test_format_placement_lists_hosts_roles_routes_and_tree():
    t = from_spec("2x2")
    text = format_placement(place(t, 1, colocate=False), t)
    assert "host0" in text and "host1" in text
    lines = text.splitlines()
    row3 = next(ln for ln in lines if ln.split()[:2] == ["3", "1"])
    assert row3.split()[2:5] == ["rollout", "0", "tcp"] and "from 2 (local)" in row3
    row2 = next(ln for ln in lines if ln.split()[:2] == ["2", "0"])
    assert "leader" in row2 and "inter-node" in row2
    assert "1 inter-node copy per version" in text
