"""launch.cluster_model: the broadcast cost model, the arithmetic placement shape, weak
scaling and the ``dvla plan`` command."""

import itertools
import math
import time

import pytest

from launch import cluster_model
from launch.placement import place
from dvla.app.plan import main
from launch.cluster_model import (
    PLACE_MAX_RANKS,
    flat_broadcast,
    hierarchical_broadcast,
    learner_count,
    parse_count,
    parse_nodes,
    estimate,
    placement_shape,
    weak_scaling,
)
from launch.topology import from_spec

NET, LOCAL, ALPHA = 400e9 / 8, 2400e9 / 8, 10e-6


def test_hand_computed_two_nodes_of_two():
    size = 1e9
    flat = flat_broadcast(2, 2, size, NET, LOCAL, ALPHA)
    # NCCL's ring 0 -> 1 -> 2 -> 3, pipelined: three hops of latency, the NIC's bandwidth once.
    assert flat.rounds == 3 and flat.nic_streams == 1 and flat.inter_node_copies == 1
    assert flat.time_s == pytest.approx(3 * ALPHA + size / NET)
    assert flat_broadcast(1, 4, size, NET, LOCAL, ALPHA).time_s == pytest.approx(3 * ALPHA + size / LOCAL)
    hier = hierarchical_broadcast(2, 2, size, NET, LOCAL, ALPHA, bucket_bytes=1e8)
    t1, t2 = ALPHA + size / NET, ALPHA + size / LOCAL
    assert hier.buckets == 10 and hier.inter_node_copies == 1 and hier.inter_node_bytes == size
    assert hier.time_s == pytest.approx(t1 + t2 / 10)


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("params", [1e3, 1e6, 7e9, 1e12])
def test_flat_ring_and_hierarchical_tree_cost_about_the_same(gpus, params):
    """Against NCCL's pipelined ring the hierarchical tree saves only latency: both cross each
    node boundary once and move S at the NIC's bandwidth. The tree pays at most one bucket of
    its local stage (its stages overlap bucket by bucket), the ring at most one alpha per rank."""
    size = params * 2
    for nodes in (1, 2, 4, 8, 64, 1024):
        flat = flat_broadcast(nodes, gpus, size, NET, LOCAL, ALPHA)
        hier = hierarchical_broadcast(nodes, gpus, size, NET, LOCAL, ALPHA)
        local_bucket = (ALPHA * (gpus - 1) + size / LOCAL) / hier.buckets
        assert hier.time_s <= flat.time_s + local_bucket + 1e-12, (nodes, gpus, params)
        assert flat.time_s <= hier.time_s + ALPHA * nodes * gpus, (nodes, gpus, params)
        assert hier.inter_node_copies == flat.inter_node_copies == nodes - 1
        assert flat.inter_node_bytes == hier.inter_node_bytes


def test_flat_grows_with_ranks_and_hierarchical_stays_near_one_nic_transfer():
    size = 14e9
    flats = [flat_broadcast(n, 8, size, NET, LOCAL, ALPHA).time_s for n in (1, 2, 4, 8, 64, 1024)]
    assert all(a < b for a, b in itertools.pairwise(flats))
    assert [flat_broadcast(4, g, size, NET, LOCAL, ALPHA).time_s < flat_broadcast(4, 2 * g, size, NET, LOCAL,
                                                                                   ALPHA).time_s
            for g in (1, 2, 4)] == [True] * 3
    for n in (2, 64, 1024):
        hier = hierarchical_broadcast(n, 8, size, NET, LOCAL, ALPHA).time_s
        assert size / NET < hier < size / NET + size / LOCAL + n * ALPHA


def test_one_trillion_params_on_1024_nodes_is_fast_and_finite():
    t0 = time.perf_counter()
    r = estimate(1024, 8, "1T")
    assert time.perf_counter() - t0 < 1.0
    assert r.ranks == 8192 and r.placement is None and r.bytes_per_version == 2e12
    assert r.hier.inter_node_copies == 1023 and r.leaders == 1024
    assert math.isfinite(r.flat.time_s) and math.isfinite(r.hier.time_s)
    assert r.hier.stage1_s == pytest.approx(1023 * ALPHA + 2e12 / NET)
    assert r.flat.time_s == pytest.approx(8191 * ALPHA + 2e12 / NET)
    assert 1 < r.speedup < 1.01  # the ring's extra latency, against 40 s of NIC transfer
    assert 0 < r.efficiency_flat < r.efficiency_hier < 1


@pytest.mark.parametrize("colocate", [False, True])
def test_arithmetic_shape_matches_place(colocate):
    for nodes in range(1, 6):
        for gpus in range(1, 5):
            for frac in (0.1, 0.25, 0.5, 0.9, 1.0):
                ranks = nodes * gpus
                n, co = learner_count(ranks, frac, colocate)
                t = from_spec(f"{nodes}x{gpus}")
                p = place(t, n, co)
                got = cluster_model._shape_of(p, t)
                assert got == placement_shape(nodes, gpus, n, co), (nodes, gpus, frac, colocate)


def test_plan_uses_place_for_small_clusters_and_arithmetic_for_large():
    small = estimate(8, 8, 7e9)
    assert small.placement is not None and small.learners == 16 == len(small.placement.learners)
    assert small.learner_hosts == 2 and small.tcp_routes == 48 and small.rollout == 48
    big_nodes = PLACE_MAX_RANKS // 8 + 1
    big = estimate(big_nodes, 8, 7e9)
    assert big.placement is None and big.leaders == big_nodes
    assert big.learners == round(0.25 * big_nodes * 8)
    one = estimate(1, 1, "500M")
    assert one.learners == 1 and one.colocate and one.flat.time_s == 0 and one.speedup == 1.0
    with pytest.raises(ValueError):
        estimate(0, 8, 7e9)
    with pytest.raises(ValueError):
        estimate(2, 8, 7e9, learner_fraction=0)


def test_learner_count():
    assert learner_count(64, 0.25, False) == (16, False)
    assert learner_count(4, 1.0, False) == (3, False)
    assert learner_count(4, 1.0, True) == (4, True)
    assert learner_count(1, 0.25, False) == (1, True)
    assert learner_count(8, 0.01, False) == (1, False)


def test_weak_scaling():
    pts = weak_scaling((1, 8, 64, 1024), params="7B")
    assert [p.nodes for p in pts] == [1, 8, 64, 1024]
    assert pts[0].efficiency_flat == pytest.approx(1) and pts[0].efficiency_hier == pytest.approx(1)
    for p in pts:
        assert 0 < p.efficiency_flat <= p.efficiency_hier <= 1 + 1e-12
        assert p.throughput_hier == pytest.approx(p.efficiency_hier * p.nodes * pts[0].throughput_hier)
    # 7B fits within a 1 s interval either way: 0.28 s over the NIC (the ring adds 82 ms of latency
    # at 8192 ranks, the tree 10 ms).
    assert pts[-1].efficiency_hier == pytest.approx(1) and pts[-1].efficiency_flat == pytest.approx(1)
    # A version every 0.3 s: the ring's latency is what tips it over.
    tight = weak_scaling((1, 1024), params="7B", update_s=0.3, batch_per_node=300)
    assert tight[1].efficiency_flat < tight[1].efficiency_hier == pytest.approx(1)
    # A version every 0.1 s no longer hides a ~0.3 s broadcast at 1024 nodes.
    fast = weak_scaling((1, 1024), params="7B", update_s=0.1, batch_per_node=100)
    assert fast[1].efficiency_hier == pytest.approx(max(0.1, fast[0].broadcast_hier_s) / fast[1].broadcast_hier_s)
    assert fast[1].efficiency_hier < 0.5


def test_parse_count_and_nodes():
    assert parse_count("7e9") == 7e9 and parse_count("7B") == 7e9 and parse_count("1T") == 1e12
    assert parse_count("500M") == 5e8 and parse_count("1.5b") == 1.5e9 and parse_count(70) == 70
    for bad in ("7X", "-1", "", "B", "0"):
        with pytest.raises(ValueError):
            parse_count(bad)
    assert parse_nodes("1,8,64,1024") == [1, 8, 64, 1024]
    assert parse_nodes(["1", "8,64"]) == [1, 8, 64]
    for bad in ("0", "a", ",", "1,-2"):
        with pytest.raises(ValueError):
            parse_nodes(bad)


def test_bucket_size_matches_the_control_plane():
    from planes.control import DEFAULT_BUCKET_BYTES

    assert cluster_model.BUCKET_BYTES == DEFAULT_BUCKET_BYTES


def test_main_prints_the_table(capsys):
    assert main(["--nodes", "1,8,1024", "--params", "7B"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.split()[:3] == ["nodes", "ranks", "learners"])
    assert "speed-up" in header and "eff" in header
    rows = {}
    for ln in lines[lines.index(header) + 2:]:
        if not ln.strip()[:1].isdigit():
            break
        rows[ln.split()[0]] = ln.split()
    assert list(rows) == ["1", "8", "1024"]
    assert rows["1"][:5] == ["1", "8", "2", "0", "0"]
    assert rows["8"][:5] == ["8", "64", "16", "7", "7"]
    assert rows["1024"][:5] == ["1024", "8192", "2048", "1023", "1023"]
    assert "14 GB per weights version" in out
    assert "alpha + m/B" in out and "pipelined ring" in out  # the model is stated


def test_main_show_placement_and_errors(capsys):
    assert main(["--nodes", "2", "--gpus-per-node", "2", "--params", "1e6", "--show-placement"]) == 0
    out = capsys.readouterr().out
    assert "host1 (ranks 2-3)" in out and "leader, from 0 (inter-node)" in out
    assert main(["--nodes", "1024", "--show-placement"]) == 0
    assert "too large to list" in capsys.readouterr().out
    for bad in (["--nodes", "0"], ["--learner-fraction", "2"]):
        with pytest.raises(SystemExit) as exc:
            main(bad)
        assert exc.value.code == 2
    # not a count: the name of a registered policy, which it is not
    assert main(["--params", "seven"]) == 2 and "unknown policy 'seven'" in capsys.readouterr().err


def test_memory_per_rank_today_and_sharded():
    """7B parameters: a replicated fp32 learner holds weights, gradients and two Adam moments
    (16 B/param) and, as the source, an fp32 snapshot (4 B/param); colocated, also two fp32
    replicas. Sharded over 8 learners the 16 B/param split 8 ways and the snapshot is held in
    the publish dtype; LoRA-like training (1% trainable) leaves little besides the weights."""
    from launch.cluster_model import rank_memory

    p = 7e9
    assert rank_memory(p).total == 20 * p
    assert rank_memory(p, rolls_out=True).total == 28 * p
    assert rank_memory(p, kl=True).total == 24 * p
    sharded = rank_memory(p, learners=8, sharded=True, publish_bytes=2)
    assert sharded.weights == 4 * p / 8 and sharded.optimizer == 8 * p / 8 and sharded.snapshot == 2 * p
    assert sharded.total == 16 * p / 8 + 2 * p
    assert rank_memory(p, learners=8, sharded=True, kl=True, source=False).reference == 4 * p / 8
    assert rank_memory(p, learners=8, sharded=True, source=False).total * 8 == rank_memory(p, source=False).total
    assert rank_memory(p, learns=False, rolls_out=True, publish_bytes=2).total == 4 * p
    lora = rank_memory(p, trainable=0.01, source=False)
    assert lora.total == (4 + 12 * 0.01) * p


def test_main_prints_memory_per_rank(capsys):
    assert main(["--nodes", "1,8", "--params", "7B", "--trainable", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out and "learner fsdp" in out
    row = next(line.split() for line in out.splitlines() if line.split()[:2] == ["8", "16"])
    # 16 learners, half the parameters train: fp32 4 + 6 + 4 (snapshot) = 14 B/param = 98 GB;
    # sharded (4 + 6) / 16 B/param + a 2 B/param snapshot = 18.4 GB; rollout 8 / 4 B/param.
    assert row[2:4] == ["98", "GB"] and row[4:6] == ["18.4", "GB"] and row[6:10] == ["56", "GB", "28", "GB"]
    with pytest.raises(SystemExit):
        main(["--params", "7B", "--trainable", "0"])
    assert "--trainable 0.0: a share in (0, 1]" in capsys.readouterr().err
