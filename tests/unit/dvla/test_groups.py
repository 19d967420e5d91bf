"""Joining the job's process group (dvla/distributed/groups.py, ``init_from_env``): a rank on a
GPU binds its NCCL group to that GPU as the group is made (issue #48, 7), so that the
communicator is built then and not by the first collective (``shutdown()``'s barrier, on a
rank whose peer has left, would wait out the whole collective timeout). On the CPU the group
is gloo's alone and bound to no device. Ranks of a host that would share a GPU are refused
NCCL with one line (issue #48, 6). Real groups of one rank, through the environment torchrun
gives; the GPU tests run in bench/gpu_kit.sh's cuda-tests step."""

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


@pytest.mark.parametrize("visible, world, shared", [
    ("0", 2, True),  # one GPU listed for two ranks: round-robin, both on it
    ("0,1", 3, True),  # ranks 0 and 2 on GPU 0
    ("0,1", 2, False),
    (None, 2, False),  # unset: each rank its own ordinal
])
def test_ranks_that_would_share_a_gpu_are_refused_nccl_with_one_line(visible, world, shared):
    """Issue #48, 6: with NCCL every rank needs a GPU of its own. The check reads what
    ``visible_device_env`` did to the rank's environment (the host's list, narrowed), as a
    rank under torchrun sees it; with gloo sharing is allowed."""
    from memory.runtime import visible_device_env
    from dvla.config.errors import ConfigError
    from dvla.distributed.groups import check_one_gpu_each

    base = {"LOCAL_WORLD_SIZE": str(world), **({"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {})}
    env = {**visible_device_env(0, base), "LOCAL_RANK": "0"}
    check_one_gpu_each("gloo", env)
    if not shared:
        check_one_gpu_each("cpu:gloo,cuda:nccl", env)
        return
    with pytest.raises(ConfigError, match=r"swimlane.collective_backend: local ranks 0, \d of this host would share "
                                          r"one GPU .* set swimlane.collective_backend=gloo"):
        check_one_gpu_each("cpu:gloo,cuda:nccl", env)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_ranks_on_one_gpu_with_nccl_stop_with_one_line(tmp_path):
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "dvla.launch", "--preset", "debug", "run.device=cuda", "run.iterations=1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("dvla:")]
    assert proc.returncode != 0 and len(lines) == 1 and "would share one GPU" in lines[0], proc.stderr[-3000:]
    assert "Duplicate GPU" not in proc.stderr
