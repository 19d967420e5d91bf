"""Joining the job's process group (dvla/distributed/groups.py, ``init_from_env``): a rank on a
GPU binds its NCCL group to that GPU as the group is made (issue #48, 7), so that the
communicator is built then and not by the first collective (``shutdown()``'s barrier, on a
rank whose peer has left, would wait out the whole collective timeout). On the CPU the group
is gloo's alone and bound to no device. Real groups of one rank, through the environment
torchrun gives."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from dvla.distributed.groups import init_from_env, shutdown


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_rank(monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    yield
    shutdown(barrier=False)


def test_a_cpu_rank_joins_gloo_bound_to_no_device(one_rank):
    assert init_from_env(timeout_s=30, device="cpu") == (0, 1)
    group = dist.distributed_c10d._get_default_group()
    assert dist.get_backend() == "gloo" and group.bound_device_id is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_rank_binds_its_nccl_group_to_its_gpu(one_rank):
    assert init_from_env(timeout_s=30, device="cuda") == (0, 1)
    group = dist.distributed_c10d._get_default_group()
    assert "nccl" in str(dist.get_backend_config()) and group.bound_device_id == torch.device("cuda", 0)
    dist.barrier()  # on the bound device: no "devices used by this process are currently unknown"
