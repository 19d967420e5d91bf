"""One order of collectives on every learner rank (swimlane/agreement/ordering.py), on real gloo
groups: two threads per rank, one all-reducing "gradients", one broadcasting weights, each
delayed at random and differently on each rank. Gloo would not deadlock on a different
order (NCCL can), so the test records the order in which each rank issued its collectives
and requires it to be the same on every rank, and the documented one."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
from tests.helpers.ranks import RankPool, ordered_lanes

from swimlane.agreement.ordering import CollectiveOrder

N, EVERY = 10, 3


def _worker(rank: int, port: int, world: int, gated: bool, out) -> None:
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        learners, control = dist.new_group([0, 1]), dist.new_group(list(range(world)))
        seq: list[str] = []
        order = CollectiveOrder(enabled=gated, start=0, every=EVERY, last=N, poll_s=0.005)
        if rank < 2:
            seq = ordered_lanes(rank, order, learners, control, N)
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


pytestmark = pytest.mark.xdist_group("ordering")  # one worker: its two runs share the pool below


@pytest.fixture(scope="module")
def pool():
    """The two runs below share one set of spawned ranks (each run its own process group)."""
    with RankPool() as ranks:
        yield ranks


def run(pool: RankPool, gated: bool, world: int = 3) -> dict[int, list[str]]:
    return pool.run(_worker, world, world, gated)


def expected() -> list[str]:
    seq = ["broadcast 0"]
    for v in range(1, N + 1):
        seq += [f"update {v}"] + ([f"broadcast {v}"] if v % EVERY == 0 or v == N else [])
    return seq + ["broadcast -1"]


def test_learners_issue_collectives_in_one_order(pool):
    res = run(pool, gated=True)
    assert res[0] == expected(), res[0]
    # Rank 1 waits for the version after the last (N + EVERY) and gets the shutdown marker.
    assert res[1] == [s if s != "broadcast -1" else f"broadcast {N + EVERY}" for s in expected()]
    assert res[2] == [s for s in expected() if s.startswith("broadcast") and s != "broadcast -1"]


def test_without_the_order_the_learners_disagree(pool):
    """The same lanes without the gates: the random delays reorder the collectives on one
    rank against the other (what would deadlock NCCL)."""
    res = run(pool, gated=False)
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
