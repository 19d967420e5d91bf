"""The rank's device discipline (memory/runtime.py), kept by a recording fake of the runtime
that runs the GPU code paths with tensors on the CPU (tests/helpers/fake_runtime.py): every thread
binds the device before it touches it, no collective runs on a compute stream, no version
announcement waits in a collective, each pool has one thread, and a pinned block goes out
again only after its copies. And: no module outside the runtime calls torch.cuda."""

import ast
import os
import subprocess
import sys
import threading

import pytest
import torch

from dvla.config import apply_overrides
from dvla.config.presets import debug
from tests.helpers.fake_runtime import FakeRuntime, installed
from memory import MemoryManager, TransientPool
from memory.runtime import DisciplineError, Runtime, visible_device_env
from tests.helpers.ranks import spawn_ranks
from swimlane import Swimlane
from tests.helpers import ROOT

PACKAGES = ("dvla", "planes", "swimlane", "memory", "launch")


def test_no_module_outside_the_runtime_calls_torch_cuda():
    offenders = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if path == ROOT / "memory" / "runtime.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                bad = (isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name)
                       and node.value.id == "torch")
                bad |= isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.cuda") and (
                    node.module == "torch.cuda" or any(a.name == "cuda" for a in node.names))
                bad |= isinstance(node, ast.Import) and any(a.name.startswith("torch.cuda") for a in node.names)
                if bad:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, "torch.cuda outside memory/runtime.py: " + ", ".join(offenders)


def _cfg(tmp_path, *extra):
    return apply_overrides(debug(), [f"run.out_dir={tmp_path}", "run.iterations=6", "swimlane.env_groups=2",
                                     "swimlane.cuda_streams=true", "memory.enabled=true", *extra])


def test_a_colocated_async_swimlane_keeps_the_discipline(tmp_path):
    """Streams, three pools (persistent, the gradient lane's, the inference lane's), pinned
    rollout buffers with asynchronous copies, and an env error that drops a batch (its pinned
    buffers go back to the pool without a build): no violation, and the run learns to the end."""
    with installed() as fake:
        lanes = Swimlane(_cfg(tmp_path))
        real_step, calls = lanes.envs[1].step, {"n": 0}

        def flaky_step(actions):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("contact solver diverged")
            return real_step(actions)

        lanes.envs[1].step = flaky_step
        # A forward pass waits for both groups: its batch comes from its pool. The groups'
        # first requests come together: 0.1 s gives the same 4 batched passes as 1 s did, in
        # 5 s instead of 40 (a pass for one group waits it out); 0 gives none.
        lanes.lanes.inference.wait_s = 0.1
        assert lanes.parts.host_pool is not lanes.memory.transient and lanes.parts.host_pool.pin_memory
        summary = lanes.run()
    assert fake.violations == []
    assert summary["version"] == 6 and summary["env_errors"] == 1
    assert lanes.memory.inference.stats().allocations > 0 and lanes.parts.host_pool.stats().reuses > 0


def test_lanes_taking_turns_with_pools_keep_the_discipline(tmp_path):
    """With ``swimlane.take_turns`` the sampling lane answers its own requests in the
    inference lane's pool; the autotune knob then switches turns off (here at the second
    update) and the inference lane's thread answers again: no violation, and the run learns
    to the end (#48, item 2)."""
    with installed() as fake:
        def switch(record):
            if record["version"] == 2:
                lanes.lanes.inference.turns.set(False)

        lanes = Swimlane(_cfg(tmp_path, "swimlane.take_turns=true"), on_update=switch)
        lanes.lanes.inference.wait_s = 0.1  # the groups' first requests: one batch, made in the pool
        summary = lanes.run()
    assert fake.violations == []
    assert summary["version"] == 6 and "dvla-sampling" in fake.routed["transient_inference pool"]


def test_both_lanes_that_answer_requests_make_batches_in_the_inference_pool_in_turn(tmp_path):
    """Which lane's thread makes a new block in the inference pool while the lanes switch
    between taking turns and overlapping depends on timing; here each does in turn, through
    the rank's own lanes: the inference lane's thread answers two groups in one pass, the
    pool drops its cached blocks, and the sampling lane answers two more while turns are on.
    A brief routing under the pool's lock is no ownership: neither is refused (#48, item 2;
    a pool owned by its first thread stopped the run with a DisciplineError here)."""
    from swimlane.lanes.messages import Request

    with installed() as fake:
        fake.bind_thread()
        lanes = Swimlane(_cfg(tmp_path))
        inference, obs = lanes.lanes.inference, lanes.envs[0].reset()
        answered, first_done, both_done = [], threading.Event(), threading.Event()

        def answer_two(serve: bool):
            fake.bind_thread()
            for group in (0, 1):
                inference.requests.put(Request(group, "act", obs))
            answered.append(inference.serve() if serve else inference.step(1.0))

        def inference_thread():  # (alive until the other has answered: a thread's id is reused after it ends)
            try:
                answer_two(serve=False)
            finally:
                first_done.set()
            both_done.wait(30)

        first = threading.Thread(target=inference_thread, name="dvla-inference")
        first.start()
        first_done.wait(30)
        lanes.memory.inference.trim()
        inference.turns.set(True)
        refused = _in_thread(lambda: answer_two(serve=True), "dvla-sampling")
        both_done.set()
        first.join()
    assert refused == [] and answered == [True, True] and fake.violations == []
    assert fake.routed["transient_inference pool"] == {"dvla-inference", "dvla-sampling"}
    assert lanes.memory.inference.stats().allocations >= 2


def test_the_fake_catches_a_thread_that_never_bound_the_device():
    fake = FakeRuntime()
    t = threading.Thread(target=lambda: fake.synchronize(), name="unbound")
    t.start()
    t.join()
    fake.bind_thread()
    fake.synchronize()
    assert fake.violations == ["unbound: synchronize before the thread bound the rank's device"]


def _in_thread(fn, name: str) -> list[str]:
    errors = []

    def body():
        try:
            fn()
        except DisciplineError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=body, name=name)
    t.start()
    t.join()
    return errors


def test_a_pool_held_for_passes_is_one_threads():
    """PyTorch refuses a second thread recording to a MemPool; a pool one thread routes whole
    passes into (the gradient lane's activations) is that thread's, and every runtime (the
    CPU's too) refuses another, naming the pool and both threads."""
    rt, pool = Runtime(), object()
    with rt.allocate_in(pool, "transient pool", held=True):
        pass

    def other():
        with rt.allocate_in(pool, "transient pool"):
            pass

    errors = _in_thread(other, "dvla-inference")
    assert len(errors) == 1 and "'dvla-inference' allocates into a memory pool that thread 'MainThread' owns" \
        in errors[0]


def test_brief_routings_take_turns_in_one_pool_and_never_overlap():
    """An arena block is routed into its pool briefly, under the pool's lock: any thread may
    (the sampling lane answering requests in the inference lane's pool while the lanes take
    turns), but two threads at once are refused (PyTorch would refuse the second)."""
    rt, pool = Runtime(), object()

    def routed():
        with rt.allocate_in(pool, "transient_inference pool"):
            pass

    routed()
    assert _in_thread(routed, "dvla-sampling") == []  # in turn: fine
    with rt.allocate_in(pool, "transient_inference pool"), rt.allocate_in(pool, "transient_inference pool"):
        overlapping = _in_thread(routed, "dvla-sampling")  # (nested in one thread: one routing)
    assert len(overlapping) == 1 and "'dvla-sampling' allocates into a memory pool while thread 'MainThread' does" \
        in overlapping[0]
    assert _in_thread(routed, "dvla-sampling") == []  # the routing ended with its block


def test_near_capacity_a_pool_gives_its_unused_segments_back(monkeypatch):
    """An arena block that meets a full device: the pool drops its cached blocks and its
    MemPool (a live one keeps its free segments from the default pool, where the backward
    pass allocates), takes a fresh one, empties the cache and tries once more (#48, item 4).
    Not while a pass routes into the pool: then the blocks only."""
    with installed() as fake:
        fake.bind_thread()
        pool = TransientPool("cpu", None, name="transient")
        cached = pool.empty((256,), torch.float32)
        pool.release(cached)
        first, real = pool.mempool, pool._allocate
        full = {"n": 0}

        def allocate(size):
            full["n"] += 1
            if full["n"] == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (the device is full)")
            return real(size)

        monkeypatch.setattr(pool, "_allocate", allocate)
        t = pool.empty((4096,), torch.float32)
        assert t.numel() == 4096 and pool.mempool is not first and pool.mempools_retired == 1
        assert fake.emptied == 1 and pool.stats().reserved_bytes == pool._live[t.data_ptr()].block.size
        pool.release(t)
        with pool.activations():  # a pass routes into the pool: it must keep its MemPool
            full["n"] = 0
            pool.trim()
            pool.empty((8192,), torch.float32)
        assert pool.mempools_retired == 1 and fake.emptied == 1 and fake.violations == []


def test_a_transient_budget_counts_what_lives_in_the_pools_segments():
    """On a GPU the transient pool's budget holds for all its MemPool holds, the activations
    routed there as well as the arena's blocks (#48, item 4; the arena alone was counted)."""
    from memory import PoolBudgetError
    from tests.helpers.fake_runtime import FakePool

    class Segments(FakePool):
        activations = 0

        def snapshot(self, include_traces=True):
            return [{"device": None, "total_size": 8 << 20, "allocated_size": self.activations + arena()}]

    with installed(FakeRuntime()) as fake:
        fake.bind_thread()
        fake.new_mempool = lambda device=None: Segments()
        pool = TransientPool("cpu", 2 << 20, name="transient")
        arena = lambda: pool._reserved  # noqa: E731 (the arena's blocks live in the segments too)
        pool.release(pool.empty((256 << 10,), torch.float32))  # 1 MiB of arena: within 2 MiB
        pool.mempool.activations = 1 << 20  # a forward pass holds 1 MiB of activations there
        pool.trim()
        pool.release(pool.empty((256 << 10,), torch.float32))  # 1 + 1 MiB: still within
        with pytest.raises(PoolBudgetError, match="transient"):
            pool.empty((512 << 10,), torch.float32)  # 2 MiB more beside the activations: over


def test_a_cuda_runtime_made_for_a_pool_is_not_installed():
    """``for_device`` on a CUDA device gives CUDA's runtime without installing it: a pool (or
    a test) that asked for one leaves the process's runtime as it was, and a CPU pool never
    gets a CUDA MemPool. A rank installs it for its life (``serving``) and removes it after.
    (No CUDA call is made: a CudaRuntime touches the device only when used.)"""
    from memory import runtime

    cpu = runtime.current()
    made = runtime.for_device("cuda")
    assert isinstance(made, runtime.CudaRuntime) and runtime.current() is cpu
    assert runtime.for_device("cuda:0") is made and made.new_mempool("cpu") is None
    with runtime.serving("cuda") as rt:
        assert rt is made and runtime.current() is made
        assert TransientPool("cpu", None, name="host").mempool is None  # (a MemPool would need CUDA here)
    assert runtime.current() is cpu


def test_a_swimlane_run_leaves_the_runtime_it_found(tmp_path, monkeypatch):
    """A rank's swimlane installs its device's runtime while it lives and puts back the one it
    found when its run ends (here the device's runtime is a fake, as CUDA's would be)."""
    from memory import runtime

    fake, cpu = FakeRuntime(), runtime.current()
    fake.bind_thread()
    monkeypatch.setattr(runtime, "for_device", lambda device: fake)
    lanes = Swimlane(_cfg(tmp_path, "run.iterations=2"))
    assert runtime.current() is fake and lanes.memory.inference.mempool is not None
    with fake.watching():
        lanes.run()
    assert runtime.current() is cpu and fake.violations == []


def test_a_pinned_block_waits_for_its_copies_before_it_goes_out_again():
    with installed() as fake:
        fake.bind_thread()
        pool = TransientPool("cpu", None, name="host", pin_memory=True)
        t = pool.empty((64,), torch.float32)
        fake.copy_async(t, torch.ones(64))  # a device -> host copy still in flight
        pool.release(t)  # records an event after it
        again = pool.empty((64,), torch.float32)  # the host waits for the event first
        assert again.data_ptr() == t.data_ptr()
        # Without the event (a release that records none), the fake flags the reuse.
        fake.copy_async(again, torch.ones(64))
        block = pool._live[again.data_ptr()].block
        pool.release(again)
        block.event = None
        pool.empty((64,), torch.float32)
    assert fake.violations == ["MainThread: a pinned block is handed out again before the event after its copies "
                               "was waited for"]


def test_the_memory_manager_gives_each_lane_a_pool_of_its_own():
    with installed() as fake:
        fake.bind_thread()
        m = MemoryManager("cpu")
        pools = [m.persistent.mempool, m.transient.mempool, m.inference.mempool]
        assert all(p is not None for p in pools) and len({id(p) for p in pools}) == 3
        assert "mem/transient_inference/reserved_mb" in m.metrics()


def test_visible_devices_narrow_to_the_rank_own_gpu():
    assert visible_device_env(1, {"CUDA_VISIBLE_DEVICES": "3,5"})["CUDA_VISIBLE_DEVICES"] == "5"
    assert visible_device_env(2, {})["CUDA_VISIBLE_DEVICES"] == "2"
    assert visible_device_env(0, {"CUDA_VISIBLE_DEVICES": ""})["CUDA_VISIBLE_DEVICES"] == ""  # none to narrow
    assert visible_device_env(3, {"CUDA_VISIBLE_DEVICES": "4"})["CUDA_VISIBLE_DEVICES"] == "4"  # shared


# -- two processes: a learner-only rank 0 and a rollout-only rank 1, on gloo ------------------


def _receiver_worker(rank: int, port: int, out_dir: str, queue) -> None:
    import torch.distributed as dist

    from dvla.distributed import shutdown
    from tests.helpers.fake_runtime import installed as fake_installed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    try:
        with fake_installed() as fake:
            dist.init_process_group("gloo", rank=rank, world_size=2)
            cfg = apply_overrides(debug(), [f"run.out_dir={out_dir}", "run.iterations=4", "swimlane.colocate=false",
                                            "swimlane.cuda_streams=true", "memory.enabled=true",
                                            "swimlane.collective_timeout_s=77"])
            lanes = Swimlane(cfg, rank=rank, world_size=2)
            timeouts = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                        for g in (lanes.parts.groups.learner, lanes.parts.groups.control)
                        if isinstance(g, dist.ProcessGroup)]  # (rank 1 is no member of the learners')
            summary = lanes.run()
            with fake.collective():
                shutdown()
        queue.put((rank, {"violations": fake.violations, "version": summary["version"],
                          "replica_version": summary.get("replica_version"), "collectives": fake.collectives,
                          "role": summary["role"], "timeouts": timeouts}))
    except BaseException as exc:  # noqa: BLE001
        import traceback

        queue.put((rank, {"error": f"{exc!r}\n{traceback.format_exc()}"}))


def test_a_rollout_only_receiver_keeps_the_discipline(tmp_path):
    """Rank 1 receives every version into its standby replica while rank 0 learns: every
    collective on a communication stream, every thread bound, every pool one thread's."""
    got = spawn_ranks(_receiver_worker, 2, str(tmp_path / "run"), timeout=240)
    for rank in (0, 1):
        assert got[rank]["violations"] == [], got[rank]["violations"]
        assert got[rank]["collectives"] > 0
        assert set(got[rank]["timeouts"]) == {77.0}  # swimlane.collective_timeout_s on every group
    assert len(got[0]["timeouts"]) == 2
    assert got[0]["role"] == "learner" and got[1]["role"] == "rollout"
    assert got[0]["version"] == 4 and got[1]["replica_version"] == 4


def test_waiting_for_a_version_issues_no_collective():
    """A receiver waits for the next version on the store: no collective is pending while
    the learner has not published (a pending NCCL receive would hold the GPU), and a stop
    ends the wait."""
    got = spawn_ranks(_announce_worker, 2, timeout=120)
    assert got[1] == {"stopped": None, "collectives_while_waiting": 0, "then": [3, [7, 8]]}


def _announce_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    from planes.control import WeightBroadcaster

    try:
        with installed() as fake:
            fake.bind_thread()
            dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
            bc = WeightBroadcaster(torch.nn.Linear(3, 2), src=0, header_words=2)
            if rank == 0:
                store = dist.distributed_c10d._get_default_store()
                store.wait(["receiver-waited"])
                bc.publish(3, [7, 8])
                queue.put((0, {}))
            else:
                before = fake.collectives
                stop = threading.Event()
                threading.Timer(0.3, stop.set).start()
                stopped = bc.receive_version(stop)  # nothing announced yet: waits, then stops
                while_waiting = fake.collectives - before
                dist.distributed_c10d._get_default_store().set("receiver-waited", "1")
                v = bc.receive_version()
                bc.receive_buckets(v)
                queue.put((1, {"stopped": stopped, "collectives_while_waiting": while_waiting,
                               "then": [v, bc.header]}))
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        import traceback

        queue.put((rank, {"error": f"{exc!r}\n{traceback.format_exc()}"}))


@pytest.mark.slow
def test_each_torchrun_rank_sees_only_its_own_gpu(tmp_path):
    """Before CUDA starts, the launcher narrows CUDA_VISIBLE_DEVICES to the rank's own GPU, so
    torch, genesis and renderers agree on it (cuda:0 in every rank)."""
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dvla.launch",
           "--preset", "debug", "run.iterations=2", f"run.out_dir={out}", "run.name=r", "run.progress=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "3,5"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    assert json.loads((out / "r" / "summary.json").read_text())["cuda_visible_devices"] == "3"
    assert json.loads((out / "r" / "summary_rank1.json").read_text())["cuda_visible_devices"] == "5"


def test_setup_pys_torch_floor_is_the_runtimes_and_this_torch_meets_it():
    """Issue #48, 9: setup.py allowed torch 2.6, but MemPool.snapshot(include_traces=...) and
    use_mem_pool's per-thread routing need 2.11: the floor is the oldest torch a run is tested
    on, stated once for the package (memory.runtime.TORCH_FLOOR) and once for pip."""
    import re

    from memory.runtime import TORCH_FLOOR
    from tests.helpers import ROOT

    floor = re.search(r'"torch>=(\d+)\.(\d+)', (ROOT / "setup.py").read_text())
    assert floor and (int(floor[1]), int(floor[2])) == TORCH_FLOOR
    assert tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= TORCH_FLOOR
