"""One order of collectives on every learner rank (swimlane/ordering.py), on real gloo
groups: two threads per rank, one all-reducing "gradients", one broadcasting weights, each
delayed at random and differently on each rank. Gloo would not deadlock on a different
order (NCCL can), so the test records the order in which each rank issued its collectives
and requires it to be the same on every rank, and the documented one."""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import socket
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from swimlane.ordering import CollectiveOrder

CTX = mp.get_context("spawn")
N, EVERY = 10, 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lanes(rank: int, order: CollectiveOrder, learners, control, seq: list[str]) -> None:
    stop, handoff = threading.Event(), queue.Queue()
    jitter = random.Random(rank)
    errors: list[BaseException] = []

    def nap() -> None:
        time.sleep(jitter.random() * 0.02)

    def gradient() -> None:
        for v in range(1, N + 1):
            nap()
            assert order.before_update(v - 1, stop)
            seq.append(f"update {v}")
            dist.all_reduce(torch.ones(4), group=learners)
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
                dist.broadcast(torch.tensor([v]), src=0, group=control)
                order.broadcast_done(v)
                if v < 0:
                    return
                v = handoff.get()
        last = -1
        while True:
            want = order.next_published(last)
            assert order.before_broadcast(want, stop)
            nap()
            got = torch.tensor([0])
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


def _worker(rank: int, world: int, port: int, gated: bool, out) -> None:
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        learners, control = dist.new_group([0, 1]), dist.new_group(list(range(world)))
        seq: list[str] = []
        order = CollectiveOrder(enabled=gated, start=0, every=EVERY, last=N, poll_s=0.005)
        if rank < 2:
            _lanes(rank, order, learners, control, seq)
        else:  # a rollout-only rank: receives only, one thread, no order needed
            while True:
                got = torch.tensor([0])
                dist.broadcast(got, src=0, group=control)
                if int(got) < 0:
                    break
                seq.append(f"broadcast {int(got)}")
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, seq))
    except BaseException as exc:
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}))


def run(gated: bool, world: int = 3) -> dict[int, list[str]]:
    out, port = CTX.Queue(), free_port()
    procs = [CTX.Process(target=_worker, args=(r, world, port, gated, out)) for r in range(world)]
    for p in procs:
        p.start()
    res = {}
    try:
        for _ in range(world):
            rank, got = out.get(timeout=120)
            res[rank] = got
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, v in res.items() if isinstance(v, dict)}
    assert not errors, errors
    return res


def expected() -> list[str]:
    seq = ["broadcast 0"]
    for v in range(1, N + 1):
        seq += [f"update {v}"] + ([f"broadcast {v}"] if v % EVERY == 0 or v == N else [])
    return seq + ["broadcast -1"]


def test_learners_issue_collectives_in_one_order():
    res = run(gated=True)
    assert res[0] == expected(), res[0]
    # Rank 1 waits for the version after the last (N + EVERY) and gets the shutdown marker.
    assert res[1] == [s if s != "broadcast -1" else f"broadcast {N + EVERY}" for s in expected()]
    assert res[2] == [s for s in expected() if s.startswith("broadcast") and s != "broadcast -1"]


def test_without_the_order_the_learners_disagree():
    """The same lanes without the gates: the random delays reorder the collectives on one
    rank against the other (what would deadlock NCCL)."""
    res = run(gated=False)
    assert res[0] != expected() or res[1][: len(expected()) - 1] != expected()[:-1]


@pytest.mark.parametrize("start,every,last,published", [
    (0, 3, 10, [0, 3, 6, 9, 10]), (7, 5, 20, [7, 10, 15, 20]), (0, 1, 4, [0, 1, 2, 3, 4])])
def test_published_versions(start, every, last, published):
    order = CollectiveOrder(enabled=True, start=start, every=every, last=last)
    assert [v for v in range(last + 1) if order.published(v) and v >= start] == published
    walk, v = [], -1
    while v < last:
        v = order.next_published(v)
        walk.append(v)
    assert walk == published
