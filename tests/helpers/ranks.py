"""Spawned ranks for multi-process tests: each worker gets ``(rank, port, *args, out)``,
joins a process group on ``tcp://127.0.0.1:port`` itself, and puts ``(rank, result)`` on
``out`` (a dict with ``"error"`` when it failed). Results are plain Python values: a tensor
put on the queue travels as a file descriptor that the parent fetches from the worker, which
may have exited by then (``ConnectionResetError``)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
from pathlib import Path

CTX = mp.get_context("spawn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, world: int, *args, timeout: float = 120) -> dict[int, object]:
    """Run ``target`` in ``world`` processes; their results by rank. Fails on any error."""
    out, port = CTX.Queue(), free_port()
    procs = [CTX.Process(target=target, args=(r, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    res = {}
    try:
        for _ in procs:
            rank, got = out.get(timeout=timeout)
            res[rank] = got
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, v in res.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    return res


def _pool_loop(tasks, out) -> None:
    """A :class:`RankPool` process: run each ``(target, rank, port, args)`` it is given, then
    leave no process group and the thread count it started with."""
    import torch
    import torch.distributed as dist

    threads = torch.get_num_threads()
    while (task := tasks.get()) is not None:
        target, rank, port, args = task
        try:
            target(rank, port, *args, out)
        except BaseException as exc:  # the targets report their own errors; this is a last resort
            out.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)


class RankPool:
    """Spawned processes kept for several :func:`spawn_ranks`-style calls, one set per world
    size: :meth:`run` runs a target on the set of ``world`` processes (started by the first
    call of that size). Starting a spawned process costs about 2.5 s of CPU (it imports
    torch, dvla and the test module); a module whose tests start worlds of the same size
    pays that once per rank instead of once per rank and test. Every call joins a process
    group of its own, on a fresh port, and leaves none behind. A set runs every call of its
    size on all of its processes, so what a process keeps from one call to the next (such as
    the control plane's count of broadcasters built, which must agree across ranks) moves in
    step on every rank, as within one job. A call that fails or times out kills the pool;
    the next call starts fresh processes. For targets that leave nothing else behind (no
    threads still running, no patched modules)."""

    def __init__(self):
        self.sets: dict[int, list] = {}  # world size -> [(process, its task queue)] by rank
        self.out = CTX.Queue()

    def run(self, target, world: int, *args, timeout: float = 120) -> dict[int, object]:
        if world not in self.sets:
            self.sets[world] = []
            for _ in range(world):
                tasks = CTX.Queue()
                proc = CTX.Process(target=_pool_loop, args=(tasks, self.out), daemon=True)
                proc.start()
                self.sets[world].append((proc, tasks))
        port = free_port()
        for rank, (_, tasks) in enumerate(self.sets[world]):
            tasks.put((target, rank, port, args))
        res, done = {}, False
        try:
            for _ in range(world):
                rank, got = self.out.get(timeout=timeout)
                res[rank] = got
            done = True
        finally:
            if not done:  # a rank may still be blocked in a collective: start afresh
                self.close()
        errors = {r: v for r, v in res.items() if isinstance(v, dict) and "error" in v}
        if errors:
            self.close()
        assert not errors, errors
        return res

    def close(self) -> None:
        procs = [proc for ranks in self.sets.values() for proc, _ in ranks]
        for proc in procs:  # nothing in them to keep: no need to wait for a clean exit
            proc.kill()
        for proc in procs:
            proc.join(10)
        self.sets = {}
        self.out = CTX.Queue()  # nothing a killed rank put there is read as the next call's

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def ordered_lanes(rank: int, order, learners, control, iterations: int, device: str = "cpu") -> list[str]:
    """A learner's two lanes as two threads, each delayed at random (differently on each
    rank): one all-reduces ``iterations`` updates on ``learners``, one broadcasts the
    published versions on ``control`` (rank 0 sends, then -1 to end). Both pass the
    gates of ``order`` (:class:`swimlane.agreement.ordering.CollectiveOrder`) as the lanes do.
    Returns the order in which this rank issued its collectives."""
    import queue
    import random
    import threading
    import time

    import torch
    import torch.distributed as dist

    seq: list[str] = []
    stop, handoff = threading.Event(), queue.Queue()
    jitter = random.Random(rank)
    errors: list[BaseException] = []

    def nap() -> None:
        time.sleep(jitter.random() * 0.02)

    def gradient() -> None:
        for v in range(1, iterations + 1):
            nap()
            assert order.before_update(v - 1, stop)
            seq.append(f"update {v}")
            dist.all_reduce(torch.ones(4, device=device), group=learners)
            order.updated(v)
            if rank == 0 and order.published(v):
                handoff.put(v)
        order.ended()
        handoff.put(-1)

    def broadcast() -> None:
        if rank == 0:
            v = 0
            while True:
                nap()
                seq.append(f"broadcast {v}")
                dist.broadcast(torch.tensor([v], device=device), src=0, group=control)
                order.broadcast_done(v)
                if v < 0:
                    return
                v = handoff.get()
        last = -1
        while True:
            want = order.next_published(last)
            assert order.before_broadcast(want, stop)
            nap()
            got = torch.tensor([0], device=device)
            seq.append(f"broadcast {want}")
            dist.broadcast(got, src=0, group=control)
            if int(got) < 0:
                return
            assert int(got) == want, (got, want)
            order.broadcast_done(want)
            last = want

    def guard(fn):
        def body():
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)
                stop.set()
        return body

    threads = [threading.Thread(target=guard(f)) for f in (gradient, broadcast)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return seq


def torchrun_workers(agent_pid: int) -> dict[int, int]:
    """The worker processes a torchrun agent started: global rank -> pid (from each child's
    ``RANK`` environment variable)."""
    from pathlib import Path

    out = {}
    for child in Path("/proc").iterdir():
        if not child.name.isdigit():
            continue
        try:
            ppid = int((child / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (child / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
        if ppid == agent_pid and ranks:
            out[ranks[0]] = int(child.name)
    return out


def torchrun_job(tmp_path: Path, name: str, overrides: list[str], nproc: int = 2, preset: str = "debug",
                 timeout: float = 180) -> Path:
    """``torchrun --standalone -m dvla.launch --preset PRESET OVERRIDES`` with ``nproc``
    processes, the run in ``tmp_path / name``, one intra-op thread and no TensorBoard files
    (importing TensorBoard costs about a second of CPU; tests/unit/dvla/test_metrics.py checks
    what it writes); fails with the output unless it exits 0. Returns the run directory."""
    out = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "dvla.launch", "--preset", preset, "run.torch_threads=1", "run.tensorboard=false", *overrides,
           f"run.out_dir={out.parent}", f"run.name={out.name}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[:8000]
    return out


class LineProcess:
    """A helper process that speaks JSON lines: its first line is read on start
    (:attr:`hello`); :meth:`finish` writes ``done`` and returns its next line. Killed on
    leaving the ``with`` block, whatever happened."""

    def __init__(self, cmd: list[str], **kwargs):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kwargs)
        try:
            self.hello = json.loads(self.proc.stdout.readline())
        except BaseException:
            self.close()
            raise

    def finish(self) -> dict:
        self.proc.stdin.write("done\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> "LineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rewire(swim, **parts):
    """Replace some of a built rank's parts (a channel wrapped by a test, say) and wire its
    lanes again, as the product wires them (:func:`swimlane.assembly.wiring.connect`)."""
    from swimlane.assembly.wiring import connect

    for name, value in parts.items():
        setattr(swim.parts, name, value)
    swim.lanes = connect(swim.parts, swim.state, swim.updates)
    return swim
