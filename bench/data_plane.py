"""Data-plane throughput against raw pyzmq, measured in one run.

One sender process pushes realistic trajectory chunks (64x64 RGB x 32 steps x 8 envs plus
proprio, actions, log-probs, rewards, masks and versions: ~3.2 MB) to this process over
ipc:// (or tcp:// on loopback), alternating in blocks between

* dvla: ``TrajectorySender.send`` -> msgpack envelope, packed frame of the small tensors,
  zero-copy frame of the image -> ``TrajectoryReceiver`` (strict decode, tensors as views of
  the received buffers, bounded queue) -> consumer;
* raw: a PUSH socket sending the same number of bytes as one zero-copy frame to a PULL
  socket that only receives them.

Both paths live in the same two processes for the whole run and each block starts only when
the receiver asks for it, so both see the same machine state; the order of the two alternates
from pair to pair. Prints throughput, the median over pairs of the ratio dvla/raw (target
>= 0.9), and the CPU time each process spent per message (``getrusage``: all its threads,
ZeroMQ's I/O threads included), and per thread, summed over all blocks (from ``/proc``, on
Linux). The receiver keeps freed receive buffers mapped
(``data_plane.keep_receive_buffers``, process-wide, so the raw path gets it too);
``--default-malloc`` runs both paths with glibc's defaults instead. ``--no-decode`` is a
diagnostic: the dvla path's frames (same sender) are received as plain ZeroMQ frames and not
decoded, so the ratio shows what the receiving side's decoding costs.

    python bench/data_plane.py --messages 200 --blocks 10 --transport ipc
    python bench/data_plane.py --messages 200 --blocks 10 --transport tcp --curve

``--curve`` encrypts the dvla path with CurveZMQ (the raw path stays plain), so its ratio
shows what encryption costs; comparing ``--transport ipc`` with ``tcp`` shows what the
single-host default (ipc only, no tcp port) saves.
"""

from __future__ import annotations

import argparse
import collections
import glob
import multiprocessing as mp
import os
import resource
import statistics
import tempfile
import threading
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


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, by name: the Python
    thread's name where it has one, else the kernel's (ZeroMQ's I/O threads). Linux only
    (empty elsewhere); the kernel counts in clock ticks (10 ms), so sum over many messages."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = collections.defaultdict(float)
    for task in glob.glob(f"/proc/{os.getpid()}/task/*"):
        try:
            with open(task + "/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(task + "/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[names.get(int(os.path.basename(task)), comm)] += (int(fields[11]) + int(fields[12])) / tick
    return out


def _sender(endpoints, raw_address, transport, n, blocks, go):
    chunk = make_chunk()
    payload = os.urandom(nbytes(chunk))
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.SNDHWM, 8)
    raw.connect(raw_address)
    with TrajectorySender(endpoints, DataPlaneConfig(transport=transport), sender_id="bench") as tx:
        for _ in range(2 * blocks + 2):
            mode = go.recv()
            before, threads = resource.getrusage(resource.RUSAGE_SELF), _thread_cpu()
            for i in range(n):
                if mode == "raw":
                    raw.send(payload, copy=False)
                else:
                    tx.send("rollout", chunk, {"i": i})
            go.send((_cpu_us(before, n), _thread_diff(threads)))
        tx.flush()
    raw.close(linger=-1)
    ctx.term()


def _cpu_us(before, n: int) -> tuple[float, float]:
    """User and system CPU time of this whole process (all its threads, ZeroMQ's
    included) since ``before``, in microseconds per message."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return (now.ru_utime - before.ru_utime) / n * 1e6, (now.ru_stime - before.ru_stime) / n * 1e6


def _thread_diff(before: dict[str, float]) -> dict[str, float]:
    now = _thread_cpu()
    return {k: v - before.get(k, 0.0) for k, v in now.items()}


def _bind(sock: zmq.Socket, transport: str) -> str:
    """Bind ``sock`` to a fresh ipc path or a random loopback port; returns the address."""
    if transport == "ipc":
        address = f"ipc://{tempfile.gettempdir()}/dvla-bench-{uuid.uuid4().hex[:8]}.sock"
        sock.bind(address)
        return address
    return f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=200, help="messages per block")
    ap.add_argument("--blocks", type=int, default=10, help="blocks of each kind")
    ap.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    ap.add_argument("--default-malloc", action="store_true", help="leave glibc malloc's settings alone")
    ap.add_argument("--curve", action="store_true",
                    help="the dvla path encrypted with CurveZMQ (data_plane.curve; the raw path stays plain)")
    ap.add_argument("--no-decode", action="store_true",
                    help="diagnostic: receive the dvla path's frames without decoding them")
    args = ap.parse_args()
    n = args.messages

    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PULL)
    raw.setsockopt(zmq.RCVHWM, 8)
    raw_address = _bind(raw, args.transport)
    rx = TrajectoryReceiver(DataPlaneConfig(transport=args.transport, keep_receive_buffers=not args.default_malloc,
                                            curve=args.curve))
    endpoints, frames_only = rx.endpoints, None
    if args.no_decode:  # the sender's data and heartbeats go to plain sockets; heartbeats are never read
        frames_only, hb = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
        endpoints = {"host": rx.endpoints["host"]}
        for prefix, sock in (("", frames_only), ("hb_", hb)):
            sock.setsockopt(zmq.RCVHWM, DataPlaneConfig().recv_hwm)
            endpoints[prefix + args.transport] = _bind(sock, args.transport)
    go, go_child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=_sender, args=(endpoints, raw_address, args.transport, n, args.blocks, go_child))
    proc.start()

    cpu = {"raw": [], "dvla": []}  # per block: receiver user, receiver sys, sender user, sender sys
    # per mode and process, summed over the measured blocks: thread name -> CPU seconds
    by_thread = {m: (collections.Counter(), collections.Counter()) for m in cpu}

    def receive(mode: str) -> None:  # one message; reads the image's first byte
        if mode == "raw":
            raw.recv(copy=False).buffer[0]
        elif frames_only is not None:
            frames_only.recv_multipart(copy=False)[-1].buffer[0]
        else:  # through numpy, ~1 us: indexing the 5-d tensor ([0, 0, 0, 0, 0].item()) costs ~7 us
            rx.get(timeout=60).tensors["image"].numpy().item(0)

    def block(mode: str) -> float:
        go.send(mode)
        receive(mode)
        t0 = time.perf_counter()  # from the first message on: excludes the go round trip
        before, threads = resource.getrusage(resource.RUSAGE_SELF), _thread_cpu()
        for _ in range(n - 1):
            receive(mode)
        elapsed = time.perf_counter() - t0
        rx_threads = _thread_diff(threads)
        tx_cpu, tx_threads = go.recv()
        cpu[mode].append((*_cpu_us(before, n - 1), *tx_cpu))
        by_thread[mode][0].update(rx_threads)
        by_thread[mode][1].update(tx_threads)
        return elapsed

    block("raw"), block("dvla")  # warm-up
    for counts in by_thread.values():  # sums leave out the warm-up (the medians skip cpu[m][0])
        counts[0].clear(), counts[1].clear()
    times = {"raw": [], "dvla": []}
    for b in range(args.blocks):  # the order alternates, so neither path always follows the other
        for mode in (("raw", "dvla") if b % 2 == 0 else ("dvla", "raw")):
            times[mode].append(block(mode))
    proc.join()
    rx.close()
    raw.close(linger=0)
    if frames_only is not None:
        frames_only.close(linger=0)
        hb.close(linger=0)

    size = nbytes(make_chunk())
    ratios = sorted(r / d for r, d in zip(times["raw"], times["dvla"]))
    mb = size * (n - 1) / 1e6
    malloc = "glibc defaults" if args.default_malloc else "receive buffers kept"
    decode = ", dvla frames received WITHOUT decoding (diagnostic)" if args.no_decode else ""
    decode += ", dvla path CurveZMQ-encrypted" if args.curve else ""
    print(f"chunk {size / 1e6:.2f} MB, {args.blocks} blocks x {n} messages of each kind, {args.transport}, "
          f"{malloc}{decode}")
    for name in ("raw", "dvla"):
        med = statistics.median(times[name])
        print(f"{name:5s} median {mb / med:8.1f} MB/s {(n - 1) / med:7.1f} msg/s   best {mb / min(times[name]):8.1f} MB/s")
    print(f"ratio dvla/raw per block: {' '.join(f'{r:.2f}' for r in ratios)}")
    for name in ("raw", "dvla"):
        med = [statistics.median(c[k] for c in cpu[name][1:]) for k in range(4)]  # [0] was the warm-up
        print(f"{name:5s} CPU per message (median of blocks): receiving process user {med[0]:4.0f} us "
              f"sys {med[1]:4.0f} us, sending process user {med[2]:4.0f} us sys {med[3]:4.0f} us")
    for name in ("raw", "dvla"):  # summed over all blocks: per block, the 10 ms ticks are too coarse
        parts = []  # a block is n - 1 messages on the receiving side (from the first one on), n sending
        for proc, counts, msgs in zip(("receiving", "sending"), by_thread[name], (args.blocks * (n - 1), args.blocks * n)):
            busy = ", ".join(f"{t} {v / msgs * 1e6:.0f}" for t, v in sorted(counts.items()) if v / msgs * 1e6 >= 5)
            parts.append(f"{proc} process: {busy or '-'}")
        print(f"{name:5s} CPU per message by thread (us, user + sys, threads under 5 us left out): " + "; ".join(parts))
    print(f"ratio dvla/raw = {statistics.median(ratios):.3f} (median of blocks; target >= 0.9)")


if __name__ == "__main__":
    main()
