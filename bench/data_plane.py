"""Data-plane throughput against raw pyzmq, measured in one run.

A sender process pushes realistic trajectory chunks (64x64 RGB x 32 steps x 8 envs plus
proprio, actions, log-probs, rewards, masks and versions: ~3.2 MB) to a receiver in this
process, over ipc:// (or tcp:// on loopback):

* dvla: ``TrajectorySender.send`` -> msgpack envelope + zero-copy tensor frames ->
  ``TrajectoryReceiver`` (strict decode, ``torch.frombuffer``, bounded queue) -> consumer;
* raw: a PUSH socket sending the same number of bytes as one frame (``copy=False``) to a
  PULL socket that only receives them.

Prints MB/s and messages/s of both and the ratio dvla/raw (target >= 0.9).

    python bench/data_plane.py --messages 300 --transport ipc
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
import uuid

import torch
import zmq

from planes.data import DataPlaneConfig, TrajectoryReceiver, TrajectorySender


def make_chunk(steps: int = 32, envs: int = 8, size: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "image": torch.randint(0, 256, (steps, envs, 3, size, size), dtype=torch.uint8, generator=g),
        "proprio": torch.randn(steps, envs, 12, generator=g),
        "actions": torch.rand(steps, envs, 2, 4, generator=g),
        "log_probs": torch.randn(steps, envs, generator=g),
        "rewards": torch.randn(steps, envs, generator=g),
        "valid": torch.ones(steps, envs, dtype=torch.bool),
        "policy_version": torch.zeros(steps, envs, dtype=torch.long),
    }


def nbytes(chunk) -> int:
    return sum(t.numel() * t.element_size() for t in chunk.values())


def _dvla_sender(endpoints, n, transport):
    chunk = make_chunk()
    with TrajectorySender(endpoints, DataPlaneConfig(transport=transport), sender_id="bench") as tx:
        for i in range(n):
            tx.send("rollout", chunk, {"i": i})
        tx.flush()


def _raw_sender(address, n, size):
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 8)
    s.connect(address)
    payload = os.urandom(size)
    for _ in range(n):
        s.send(payload, copy=False)
    s.close(linger=-1)
    ctx.term()


def bench_dvla(n, transport):
    ctx = mp.get_context("spawn")
    with TrajectoryReceiver(DataPlaneConfig(transport=transport)) as rx:
        p = ctx.Process(target=_dvla_sender, args=(rx.endpoints, n + 5, transport))
        p.start()
        for _ in range(5):  # warm-up: connection set-up and first allocations
            rx.get(timeout=60)
        t0 = time.perf_counter()
        for _ in range(n):
            msg = rx.get(timeout=60)
            assert msg is not None
            msg.tensors["image"][0, 0, 0, 0, 0].item()  # touch the data
        dt = time.perf_counter() - t0
        p.join()
    return dt


def bench_raw(n, size, transport):
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 8)
    if transport == "ipc":
        address = f"ipc://{tempfile.gettempdir()}/dvla-bench-{uuid.uuid4().hex[:8]}.sock"
        s.bind(address)
    else:
        address = f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}"
    p = mp.get_context("spawn").Process(target=_raw_sender, args=(address, n + 5, size))
    p.start()
    for _ in range(5):
        s.recv(copy=False)
    t0 = time.perf_counter()
    for _ in range(n):
        frame = s.recv(copy=False)
        frame.buffer[0]
    dt = time.perf_counter() - t0
    p.join()
    s.close(linger=0)
    ctx.term()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=300)
    ap.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    size = nbytes(make_chunk())
    raw_t, dvla_t = [], []
    for _ in range(args.repeats):  # interleave so both see the same machine noise
        raw_t.append(bench_raw(args.messages, size, args.transport))
        dvla_t.append(bench_dvla(args.messages, args.transport))
    raw, dv = min(raw_t), min(dvla_t)
    mb = size * args.messages / 1e6
    print(f"chunk {size / 1e6:.2f} MB, {args.messages} messages, {args.transport}, best of {args.repeats}")
    print(f"raw pyzmq   {mb / raw:8.1f} MB/s  {args.messages / raw:7.1f} msg/s")
    print(f"dvla plane  {mb / dv:8.1f} MB/s  {args.messages / dv:7.1f} msg/s")
    print(f"ratio dvla/raw = {raw / dv:.3f}  (target >= 0.9)")


if __name__ == "__main__":
    main()
