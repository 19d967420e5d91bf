"""NCCL paths on two GPUs (skipped without them): the default group of a CUDA run
(``cpu:gloo,cuda:nccl``) takes CPU metrics and CUDA gradients alike, the control plane
broadcasts CUDA weights over NCCL, and the learners' order of collectives holds with two
NCCL communicators driven from two threads (without an order this can deadlock)."""

from __future__ import annotations

import traceback

import pytest
import torch
from tests.helpers.ranks import spawn_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two CUDA devices")]
def _worker(rank: int, port: int, out) -> None:
    import torch.distributed as dist
    from torch import nn

    from dvla.distributed import allreduce_mean_grads, default_backend, mean_over_group
    from planes.control import WeightBroadcaster, new_control_group
    from tests.helpers.ranks import ordered_lanes
    from swimlane.agreement.ordering import CollectiveOrder

    try:
        torch.cuda.set_device(rank)
        dev = torch.device(f"cuda:{rank}")
        dist.init_process_group(default_backend("cuda"), rank=rank, world_size=2,
                                init_method=f"tcp://127.0.0.1:{port}")
        res = {}
        learners = dist.new_group([0, 1])
        res["mean"] = mean_over_group({"a": float(rank), "b": 2.0}, learners)  # CPU tensor: gloo
        model = nn.Linear(64, 64).to(dev)
        for p in model.parameters():
            p.grad = torch.full_like(p, float(rank))
        allreduce_mean_grads(list(model.parameters()), learners)  # CUDA tensors: NCCL
        res["grad"] = float(next(model.parameters()).grad.mean())
        control = new_control_group(device=dev)
        torch.manual_seed(rank)
        net = nn.Linear(32, 32).to(dev)
        bc = WeightBroadcaster(net, src=0, group=control)
        if rank == 0:
            bc.publish(1)
        else:
            v = bc.receive_version()
            bc.receive_buckets(v, into=[b.flat for b in bc.buckets])
        res["weights"] = float(torch.cat([p.detach().flatten() for p in net.parameters()]).sum())
        # Two threads, two communicators, one order (swimlane/agreement/ordering.py).
        order = CollectiveOrder(enabled=True, start=0, every=2, last=6)
        res["seq"] = ordered_lanes(rank, order, learners, control, 6, device=str(dev))
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, res))
    except BaseException as exc:
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}))


def test_nccl_collectives_backends_and_order():
    res = spawn_ranks(_worker, 2, timeout=300)
    for r in (0, 1):
        assert res[r]["mean"] == {"a": 0.5, "b": 2.0}
        assert res[r]["grad"] == pytest.approx(0.5)
    assert res[0]["weights"] == res[1]["weights"]
    expected = ["broadcast 0", "update 1", "update 2", "broadcast 2", "update 3", "update 4", "broadcast 4",
                "update 5", "update 6", "broadcast 6"]
    assert res[0]["seq"] == expected + ["broadcast -1"] and res[1]["seq"] == expected + ["broadcast 8"]
