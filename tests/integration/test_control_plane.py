"""Control plane: bucketed, versioned weight broadcast on real gloo process groups."""

import hashlib
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from tests.helpers.fake_runtime import FakeRuntime
from tests.helpers.ranks import RankPool, free_port
from torch import nn

from dvla.state.checkpoint import save_weights
from dvla.distributed import shutdown
from planes.subscriber import WeightSubscriber
from planes.control import (LayoutMismatchError, WeightBroadcaster, hierarchical_stages,
                            new_control_group)


def make_model(rank: int, hidden: int = 32) -> nn.Module:
    torch.manual_seed(100 + rank)  # every rank starts from different weights
    return nn.Sequential(nn.Linear(8, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, 4),
                         nn.BatchNorm1d(4))


def digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        if v.is_floating_point():
            h.update(k.encode() + v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _worker(rank, port, world, scenario, out):
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        control = new_control_group()
        result = SCENARIOS[scenario](rank, world, control)
        out.put((rank, result))
        shutdown()
    except BaseException as exc:  # report, do not hang the parent
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}))


def _broadcast(rank, world, group):
    model = make_model(rank)
    bc = WeightBroadcaster(model, src=0, group=group, bucket_bytes=1024)
    seen = []
    for version in (1, 2):
        if rank == 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.5).add_(0.1)
                model[3].running_mean.add_(version)
            bc.publish(version)
        else:
            seen.append(bc.receive())
    if rank == 0:
        bc.shutdown()
    else:
        seen.append(bc.receive())
    return {"digest": digest(model), "seen": seen, "version": bc.version, "buckets": len(bc.buckets)}


def _mismatch(rank, world, group):
    model = make_model(rank, hidden=48 if rank == world - 1 else 32)
    try:
        WeightBroadcaster(model, src=0, group=group)
    except LayoutMismatchError as exc:
        return {"mismatch": str(exc)}
    return {"mismatch": None}


def _publish_versions(model, bc, n: int) -> None:
    """Versions 1..n from the source, each every weight plus 1, then the end of the stream."""
    for version in range(1, n + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        bc.publish(version)
    bc.shutdown()


def _subscriber(rank, world, group):
    model = make_model(rank)
    bc = WeightBroadcaster(model, src=0, group=group)
    if rank == 0:
        _publish_versions(model, bc, 5)
        return {"digest": digest(model), "polled": []}
    sub = WeightSubscriber(bc)
    polled = []
    while not sub.closed:
        v = sub.poll()  # never blocks on the network
        if v is not None:
            polled.append(v)
        time.sleep(0.001)
    sub.join(10)
    v = sub.poll()
    if v is not None:
        polled.append(v)
    return {"digest": digest(model), "polled": polled}


def _subscriber_on_a_stream(rank, world, group):
    """Rank 1 polls on a lane stream of its own, under a fake runtime whose copies run only
    once something waits for them (as a GPU's): after it applied version v the receiving
    thread gets v + 1 and v + 2 (into the buffer v came from) before the poller's stream is
    synchronized. The model must then hold v, not the newer buffer's contents."""
    from tests.helpers.fake_runtime import installed

    model = make_model(rank)
    if rank == 0:
        _publish_versions(model, WeightBroadcaster(model, src=0, group=group), 10)
        return {"digest": digest(model)}
    base = make_model(0)[0].weight.detach().clone()
    with installed(FakeRuntime(defer_copies=True)) as fake:
        fake.bind_thread()
        bc = WeightBroadcaster(model, src=0, group=group)
        got = _poll_on_a_stream(bc, fake, base)
    return {"digest": digest(model), **got, "violations": fake.violations}


def _poll_on_a_stream(bc, rt, base) -> dict:
    sub = WeightSubscriber(bc)
    with rt.use_stream(rt.new_stream()):  # the inference lane's stream, say
        while (v := sub.poll()) is None:
            time.sleep(0.001)
        sub.wait_for(v + 2, timeout=60)
        later = sub.latest_version
        rt.synchronize()  # (with the fake: the poll's copies run now)
        held = float((next(bc.module.parameters()).detach().cpu() - base).mean())  # the first layer's weight
        sub.join(60)
        sub.poll()
        rt.synchronize()
    return {"polled": v, "later": later, "held": held}


def _cuda_subscriber(rank, world, group):
    """The same on a GPU both ranks share, gloo carrying CUDA tensors, the poller on a CUDA
    stream of its own."""
    from memory import runtime

    with runtime.serving("cuda") as rt:
        rt.bind_thread()
        model = make_model(rank).cuda()
        if rank == 0:
            _publish_versions(model, WeightBroadcaster(model, src=0, group=group, device=torch.device("cuda")), 10)
            return {"digest": digest(model.cpu())}
        base = make_model(0)[0].weight.detach().clone()
        bc = WeightBroadcaster(model, src=0, group=group, device=torch.device("cuda"))
        got = _poll_on_a_stream(bc, rt, base)
        return {"digest": digest(model.cpu()), **got}


def _separate_groups(rank, world, control):
    """Learners 0 and 1 all-reduce gradients on their own group while rank 0 broadcasts
    weights to everyone on the control group from another thread."""
    learners = dist.new_group([0, 1], backend="gloo")
    model = make_model(rank)
    bc = WeightBroadcaster(model, src=0, group=control)
    result = {}
    def publish_all():
        for v in (1, 2, 3):
            bc.publish(v)
        bc.shutdown()

    if rank == 0:
        t = threading.Thread(target=publish_all)
        t.start()
    elif rank >= 2:
        versions = []
        while (v := bc.receive()) >= 0:
            versions.append(v)
        result["versions"] = versions
    if rank in (0, 1):
        total = torch.zeros(1)
        for i in range(20):
            g = torch.tensor([float(rank + i)])
            dist.all_reduce(g, group=learners)
            total += g
        result["allreduce"] = total.item()
    if rank == 0:
        t.join()
    if rank == 1:
        while (v := bc.receive()) >= 0:
            pass
    result["digest"] = digest(model)
    return result


def _hierarchical(rank, world, control):
    """Two hosts, ranks [0, 1, 2] and [3, 4]: 0 sends to leader 3 once, then each leader
    fans out on its own host. Receivers take versions into a separate standby copy, and
    each version's header words (a rebalancing plan) reach every rank with it."""
    stages = hierarchical_stages(leaders=[0, 3], local_groups=[[0, 1, 2], [3, 4]], src=0)
    model = make_model(rank)
    bc = WeightBroadcaster(model, src=0, group=control, bucket_bytes=1024, stages=stages, header_words=3)
    standby = make_model(rank)
    into = bc.bind_replica(standby)
    versions, headers = [], []
    if rank == 0:
        for v in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5).add_(v)
            bc.publish(v, header=[v, 10 * v, -1])
        try:
            bc.publish(3, header=[1])
        except ValueError as exc:
            headers.append(str(exc))
        bc.shutdown()
        standby = model
    else:
        while (v := bc.receive_version()) >= 0:
            headers.append(bc.header)
            bc.receive_buckets(v, into=into)
            versions.append(v)
    return {"digest": digest(standby), "versions": versions, "headers": headers, "traffic": dict(bc.traffic),
            "stages": [(s.kind, s.root, s.size) for s in stages], "buckets": len(bc.buckets)}


def _frozen(rank, world, control):
    """A frozen first layer over a two-host tree (ranks [0, 1], [2, 3]): version 1 carries
    everything, version 2 only the trainable weights. The source changes its frozen weights
    before version 2 to show they are not sent again; a subscriber's two staging sets both
    get the frozen ones."""
    stages = hierarchical_stages(leaders=[0, 2], local_groups=[[0, 1], [2, 3]], src=0)
    model = make_model(rank)
    frozen = frozenset({"0.weight", "0.bias"})
    bc = WeightBroadcaster(model, src=0, group=control, bucket_bytes=512, stages=stages, frozen=frozen)
    sizes = []
    if rank == 0:
        first = {k: v.clone() for k, v in model.state_dict().items()}
        for v in (1, 2, 3):
            if v > 1:
                with torch.no_grad():
                    model[0].weight.add_(7.0)  # "frozen": must not reach anyone
                    model[2].weight.add_(float(v))
            bc.publish(v)
            sizes.append(bc.last_version_bytes)
        bc.shutdown()
        model[0].weight.data.copy_(first["0.weight"])  # what the receivers should hold
        return {"digest": digest(model), "sizes": sizes, "frozen_buckets": len(bc.frozen_buckets)}
    sub = WeightSubscriber(bc)
    while not sub.closed:
        sub.poll()
        time.sleep(0.001)
    sub.join(10)
    sub.poll()
    return {"digest": digest(model), "version": bc.version}


def _relay(rank, world, control):
    """Two hosts, [0, 1] and [2, 3]; rank 2, the second host's leader, and rank 1 keep no
    weights (learners that do not roll out): a meta-device layout, each version relayed
    through two scratch buffers (rank 2 passes it on to rank 3), with a frozen layer sent
    once. Rank 3 ends with the source's weights."""
    from planes.buckets import layout_copy, meta_alloc

    stages = hierarchical_stages(leaders=[0, 2], local_groups=[[0, 1], [2, 3]], src=0)
    model = make_model(rank)
    frozen = frozenset({"0.weight", "0.bias"})
    relay = rank in (1, 2)
    held = layout_copy(model, torch.float32) if relay else model
    bc = WeightBroadcaster(held, src=0, group=control, bucket_bytes=256, stages=stages, frozen=frozen,
                           alloc=meta_alloc if relay else None, device=torch.device("cpu"))
    versions, sizes = [], []
    if rank == 0:
        for v in (1, 2, 3):
            with torch.no_grad():
                model[2].weight.add_(float(v))
            bc.publish(v)
        bc.shutdown()
    else:
        while (v := bc.receive_version()) >= 0:
            (bc.relay_buckets if relay else bc.receive_buckets)(v)
            versions.append(v)
            sizes.append(bc.last_version_bytes)
    metas = {t.device.type for t in held.state_dict().values()}
    return {"digest": None if relay else digest(model), "versions": versions, "sizes": sizes, "devices": metas,
            "traffic": dict(bc.traffic), "buckets": len(bc.buckets)}


SCENARIOS = {"subscriber_on_a_stream": _subscriber_on_a_stream, "cuda_subscriber": _cuda_subscriber, "relay": _relay, "frozen": _frozen, "hierarchical": _hierarchical, "broadcast": _broadcast, "mismatch": _mismatch, "subscriber": _subscriber,
             "separate_groups": _separate_groups}


# One worker runs the module, so that its tests share the pool below.
pytestmark = pytest.mark.xdist_group("control_plane")


@pytest.fixture(scope="module")
def pool():
    """One set of spawned ranks for the module's scenarios (each its own process group):
    28 process starts become 14 (one set per world size)."""
    with RankPool() as ranks:
        yield ranks


def run_ranks(pool, scenario, world, timeout=90):
    return pool.run(_worker, world, world, scenario, timeout=timeout)


@pytest.mark.parametrize("world", [2, 4])
def test_receivers_equal_source_after_broadcast(world, pool):
    res = run_ranks(pool, "broadcast", world)
    assert res[0]["buckets"] > 1  # 1 KiB buckets force several collectives
    for r in range(1, world):
        assert res[r]["digest"] == res[0]["digest"]
        assert res[r]["seen"] == [1, 2, -1] and res[r]["version"] == 2


def test_hierarchical_broadcast_crosses_hosts_once_then_fans_out(pool):
    res = run_ranks(pool, "hierarchical", 5)
    nb = res[0]["buckets"]
    assert nb > 1
    for r in range(1, 5):
        assert res[r]["digest"] == res[0]["digest"] and res[r]["versions"] == [1, 2]
        assert res[r]["headers"] == [[1, 10, -1], [2, 20, -1]]
    assert "a header of 1 words, expected 3" in res[0]["headers"][0]
    assert res[0]["stages"] == [("inter", 0, 2), ("local", 0, 3)]
    assert res[3]["stages"] == [("inter", 0, 2), ("local", 3, 2)]
    assert res[4]["stages"] == [("local", 3, 2)]
    t = {r: res[r]["traffic"] for r in res}
    # Per version, the buckets cross between the hosts once (0 -> 3) ...
    assert t[0]["inter_sent"] == 2 * nb and t[3]["inter_received"] == 2 * nb
    assert t[3]["inter_received_bytes"] == t[0]["inter_sent_bytes"]
    # ... and each host's leader feeds its own ranks.
    assert t[0]["local_sent"] == 2 * nb and t[3]["local_sent"] == 2 * nb
    for r in (1, 2, 4):
        assert t[r]["local_received"] == 2 * nb and not any(k.startswith("inter") for k in t[r])


# (Worlds of 2, 4 and 5 ranks only: each size the pool holds costs its ranks' start, about
# 2.5 s of CPU each.)
def test_layout_mismatch_fails_on_every_rank(pool):
    res = run_ranks(pool, "mismatch", 4)
    for r in range(4):
        msg = res[r]["mismatch"]
        assert msg is not None and "rank(s) [3]" in msg


def test_subscriber_polls_without_blocking_and_ends_on_newest(pool):
    res = run_ranks(pool, "subscriber", 4)
    for r in (1, 2, 3):
        polled = res[r]["polled"]
        assert polled and polled == sorted(polled) and polled[-1] == 5
        assert res[r]["digest"] == res[0]["digest"]


def test_a_subscriber_polling_on_a_stream_never_takes_a_newer_buffer(pool):
    """The receiving thread writes a staging buffer again only after the event that follows
    the copies out of it (#48, item 5): a GPU runs them later, on the poller's stream."""
    res = run_ranks(pool, "subscriber_on_a_stream", 2)
    got = res[1]
    assert "error" not in got, got
    assert got["later"] >= got["polled"] + 2  # the buffer the version came from was written again
    assert abs(got["held"] - got["polled"]) < 1e-3, got  # version v's weights, not v + 2's
    assert got["digest"] == res[0]["digest"] and got["violations"] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_subscriber_polling_on_a_stream_holds_the_version_it_applied(pool):
    res = run_ranks(pool, "cuda_subscriber", 2)
    got = res[1]
    assert "error" not in got, got
    assert abs(got["held"] - got["polled"]) < 1e-3 and got["digest"] == res[0]["digest"], got


def test_weight_traffic_on_its_own_group(pool):
    res = run_ranks(pool, "separate_groups", 4)
    expect = sum((0 + i) + (1 + i) for i in range(20))
    assert res[0]["allreduce"] == res[1]["allreduce"] == expect
    assert res[2]["versions"] == res[3]["versions"] == [1, 2, 3]
    assert res[2]["digest"] == res[3]["digest"] == res[0]["digest"] == res[1]["digest"]


def test_single_rank_world_and_safetensors_checkpoint(tmp_path):
    from safetensors import safe_open

    port = free_port()
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        model = make_model(0).eval()
        x = torch.randn(5, 8)
        before = model(x)
        bc = WeightBroadcaster(model, src=0)
        # Parameters now live in the buckets: same values, same Parameter objects, trainable.
        torch.testing.assert_close(model(x), before)
        assert model[0].weight.data_ptr() == bc.buckets[0].flat.data_ptr()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(x).sum().backward()
        opt.step()
        assert not torch.allclose(model(x), before)
        bc.publish(3)
        save_weights(model, tmp_path / "w.safetensors", bc.version, layout=f"{bc.checksum:#x}")
        with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
            assert f.metadata()["version"] == "3" and f.metadata()["layout"] == f"{bc.checksum:#x}"
            torch.testing.assert_close(f.get_tensor("0.weight"), model[0].weight.detach())
        with pytest.raises(ValueError, match="versions must increase"):
            bc.publish(3)
        model[0].weight = torch.nn.Parameter(torch.zeros(32, 8))  # replaced behind our back
        with pytest.raises(RuntimeError, match="no longer live in the broadcast buckets"):
            bc.publish(4)
    finally:
        shutdown()


def test_frozen_weights_go_out_with_the_first_version_only(pool):
    res = run_ranks(pool, "frozen", 4)
    whole = sum(t.numel() * 4 for t in make_model(0).state_dict().values() if t.is_floating_point())
    frozen = (8 * 32 + 32) * 4
    assert res[0]["frozen_buckets"] >= 1 and res[0]["sizes"] == [whole, whole - frozen, whole - frozen]
    for r in (1, 2, 3):  # a leaf, a leader and its leaf
        assert res[r]["version"] == 3 and res[r]["digest"] == res[0]["digest"], r


def test_a_rank_without_replicas_relays_versions_through_scratch_buffers(pool):
    res = run_ranks(pool, "relay", 4)
    assert res[3]["digest"] == res[0]["digest"] and res[3]["versions"] == [1, 2, 3]
    for r in (1, 2):  # the relays hold only a meta-device layout and saw every version
        assert res[r]["devices"] == {"meta"} and res[r]["versions"] == [1, 2, 3]
    assert res[0]["buckets"] > 4  # many buckets through two scratch buffers
    assert res[2]["traffic"]["local_sent_bytes"] == res[3]["traffic"]["local_received_bytes"] > 0
    first, later = res[3]["sizes"][0], res[3]["sizes"][1]
    assert res[2]["sizes"] == res[3]["sizes"] and first > later  # the frozen layer went once
