"""The learners' small CPU collectives (``Algorithm._agree``: how many samples and stale steps
the sharded learners agree on) on process groups built as the product and the GPU suite's
bench build them: an NCCL-only group takes no CPU tensor ("No backend type associated with
device type cpu"), so bench/learner_step.py joins with the default group's backends
(``cpu:gloo,cuda:nccl`` on CUDA) and ``_agree`` puts its tensor where the group's backend
takes it."""

from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
from tests.helpers.ranks import spawn_ranks
from tests.helpers import ROOT

BENCH = ROOT / "bench"


def _learner_step():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import learner_step

    return learner_step


def test_the_bench_joins_with_gloo_for_cpu_tensors_on_cuda(monkeypatch):
    """On CUDA (faked: only the backend string is looked at) the bench's one-process group has
    the default group's backends, gloo among them for CPU tensors; on the CPU gloo."""
    learner_step = _learner_step()
    seen = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend=None, **kw: seen.append(backend))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    learner_step.join_group(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    learner_step.join_group(torch.device("cpu"))
    assert seen == ["cpu:gloo,cuda:nccl", "gloo"]
    takes = dist.BackendConfig(dist.Backend(seen[0])).get_device_backend_map()
    assert takes == {"cpu": "gloo", "cuda": "nccl"}


def test_the_collective_device_is_one_the_group_takes():
    from dvla.algos.base import collective_device

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert collective_device("cpu:gloo,cuda:nccl", cuda) == cpu  # the product's groups on CUDA
    assert collective_device("gloo", cpu) == cpu
    assert collective_device("gloo", cuda) == cpu
    assert collective_device("nccl", cuda) == cuda  # NCCL alone: CUDA tensors only
    with pytest.raises(ValueError, match="neither on the CPU"):
        collective_device("nccl", cpu)


def _agree_worker(rank: int, port: int, backend: str | None, out) -> None:
    from dvla.algos import build_algorithm
    from dvla.config import AlgoConfig
    from dvla.policy import PolicySpec
    from dvla.models.tiny_vla import TinyVLA

    try:
        torch.set_num_threads(1)
        if backend is None:  # the bench's torchrun path
            os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
            _learner_step().join_group(torch.device("cpu"))
        else:
            dist.init_process_group(backend, rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
        torch.manual_seed(0)
        algo = build_algorithm(AlgoConfig(name="grpo", group_size=4),
                               TinyVLA(PolicySpec((3, 16, 16), 4, 2), TinyVLA.Config(hidden_dim=16)))
        algo.shard_group = dist.group.WORLD  # the group the bench shards its learner over
        try:
            got = {"backend": str(dist.get_backend(dist.group.WORLD)), "agreed": algo._agree(3 + rank, 10 * rank)}
        except (RuntimeError, ValueError) as exc:
            got = {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
        out.put((rank, got))
        dist.destroy_process_group()
    except BaseException as exc:
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}))


@pytest.mark.slow
def test_agree_on_a_group_joined_the_bench_way():
    """Two CPU ranks join as bench/learner_step.py does under torchrun (the launcher's
    ``init_from_env``): the learners agree on the largest counts."""
    res = spawn_ranks(_agree_worker, 2, None)
    assert res[0] == res[1] == {"backend": "gloo", "agreed": [4, 10]}, res


@pytest.mark.slow
def test_a_group_without_a_cpu_backend_is_named_not_failed_inside():
    """What the bench's NCCL-only group did to ``_agree``, on the CPU: ``cuda:gloo`` registers a
    backend for CUDA tensors only, as ``nccl`` does. A CPU tensor used to go into the
    collective and fail there ("No backend type associated with device type cpu"); now the
    tensor goes where the group takes it, and a CPU learner, which has no such device, is told
    so plainly. (On CUDA the same group gets a CUDA tensor: the unit test above.)"""
    res = spawn_ranks(_agree_worker, 2, "cuda:gloo")
    for rank in (0, 1):
        assert res[rank]["failed"].startswith("ValueError: a process group of backend 'cuda:gloo' takes tensors "
                                              "on cuda only"), res
