"""Data plane over real ZeroMQ sockets on loopback (ipc:// and tcp://), with sender processes."""

import datetime
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import msgpack
import pytest
import torch
import zmq
import zmq.auth
from torch.distributed import TCPStore

from planes.data import (BackpressureTimeout, DataPlaneConfig, TrajectoryReceiver, TrajectorySender, lookup_endpoints,
                         remove_stale_ipc_files)
from planes.serial import encode
from tests.helpers import ROOT

CTX = mp.get_context("spawn")


def chunk(rank: int, i: int) -> dict[str, torch.Tensor]:
    """A realistic trajectory chunk: 8 steps x 4 envs of 64x64 RGB plus per-step tensors."""
    g = torch.Generator().manual_seed(1000 * rank + i)
    return {
        "image": torch.randint(0, 256, (8, 4, 3, 64, 64), dtype=torch.uint8, generator=g),
        "proprio": torch.randn(8, 4, 12, generator=g),
        "actions": torch.rand(8, 4, 2, 4, generator=g) * 2 - 1,
        "valid": torch.rand(8, 4, generator=g) > 0.2,
        "policy_version": torch.full((8, 4), i, dtype=torch.long),
    }


def _sender_proc(port: int, rank: int, n: int, transport: str, hold_s: float) -> None:
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    cfg = DataPlaneConfig(transport=transport, heartbeat_s=0.2, peer_timeout_s=1.5)
    with TrajectorySender(lookup_endpoints(store), cfg, sender_id=f"rollout{rank}") as tx:
        for i in range(n):
            tx.send("rollout", chunk(rank, i), {"rank": rank, "i": i})
        tx.flush()
        time.sleep(hold_s)  # stay alive (heartbeating) so the receiver can be killed-tested


@pytest.fixture
def store():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield s


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_round_trip_from_two_processes_is_bit_exact(store, transport):
    cfg = DataPlaneConfig(transport=transport)
    with TrajectoryReceiver(cfg, store=store) as rx:
        procs = [CTX.Process(target=_sender_proc, args=(store.port, r, 5, transport, 0.0)) for r in (0, 1)]
        for p in procs:
            p.start()
        got = {}
        deadline = time.monotonic() + 60
        while len(got) < 10 and time.monotonic() < deadline:
            msg = rx.get(timeout=1.0)
            if msg is not None:
                got[(msg.meta["rank"], msg.meta["i"])] = msg
        for p in procs:
            p.join(30)
        assert len(got) == 10
        for (rank, i), msg in got.items():
            assert msg.sender == f"rollout{rank}" and msg.seq == i and msg.kind == "rollout"
            for k, v in chunk(rank, i).items():
                assert torch.equal(msg.tensors[k], v), k
        assert rx.counters.received == 10 and not rx.counters.rejected
        assert rx.endpoints[transport].startswith(f"{transport}://")
        if transport == "tcp":
            assert rx.endpoints["tcp"].startswith("tcp://127.0.0.1:")


def test_bad_messages_are_counted_and_receiver_survives():
    with TrajectoryReceiver(DataPlaneConfig(transport="tcp")) as rx:
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.connect(rx.endpoints["tcp"])
        good = encode("rollout", {"x": torch.arange(4)}, {"sender": "s", "seq": 0})
        bad_version = [msgpack.packb({"v": 99, "kind": "k", "meta": {}, "tensors": []})]
        truncated = [good[0], bytes(good[1])[:-1]]
        no_sender = encode("rollout", {"x": torch.arange(4)}, {"seq": 0})
        for frames in ([b"garbage"], bad_version, truncated, no_sender, [b"\x80"] + [b"x"] * 3):
            raw.send_multipart(frames)
        raw.send_multipart(good)
        msg = rx.get(timeout=10)
        assert msg is not None and torch.equal(msg.tensors["x"], torch.arange(4))
        rej = rx.counters.rejected
        assert sum(rej.values()) == 5, rej
        assert rej["bad_version"] == 1 and rej["bad_tensor"] == 1 and rej["bad_envelope"] >= 2
        raw.close(linger=0)


def test_frames_that_disagree_with_the_envelope_are_rejected_whole():
    """The receiver reads data frames by the sizes the envelope declares; a frame of another
    size, or a missing or extra frame, rejects that message and drops all of its parts."""
    with TrajectoryReceiver(DataPlaneConfig(transport="tcp")) as rx:
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.connect(rx.endpoints["tcp"])
        tensors = {"small": torch.arange(4), "big": torch.zeros(64 * 1024, dtype=torch.uint8)}
        env, small, big = encode("rollout", tensors, {"sender": "s", "seq": 0})
        small, big = bytes(small), bytes(big)
        bad = [
            [env, small[:-1], big],  # small frame short
            [env, small + b"x", big],  # small frame long: truncated by recv_into, still rejected
            [env, small, big[:-1]],  # large (zero-copy) frame short
            [env, small],  # missing frame
            [env, small, big, b"extra"],  # extra frame
        ]
        for frames in bad:
            raw.send_multipart(frames)
        good = {"small": torch.arange(4) * 3, "big": torch.full((64 * 1024,), 7, dtype=torch.uint8)}
        raw.send_multipart(encode("rollout", good, {"sender": "s", "seq": 1}))
        msg = rx.get(timeout=10)
        assert msg is not None and msg.seq == 1  # nothing of a bad message was taken for a new one
        assert all(torch.equal(msg.tensors[k], v) for k, v in good.items())
        assert rx.counters.rejected == {"bad_tensor": 3, "bad_frames": 2}, rx.counters.rejected
        assert rx.counters.received == 1
        raw.close(linger=0)


def test_received_tensors_are_writable_and_never_shared_between_messages():
    cfg = DataPlaneConfig(transport="ipc")
    with TrajectoryReceiver(cfg) as rx, TrajectorySender(rx.endpoints, cfg, sender_id="s") as tx:
        for i in range(3):
            tx.send("rollout", chunk(0, i))
        msgs = [rx.get(timeout=10) for _ in range(3)]
        for i, msg in enumerate(msgs):
            for k, v in chunk(0, i).items():
                assert torch.equal(msg.tensors[k], v), (i, k)
        small = msgs[0].tensors["proprio"]
        small += 1  # small tensors live in a buffer of their own message, not a shared one
        assert torch.equal(small, chunk(0, 0)["proprio"] + 1)
        assert torch.equal(msgs[1].tensors["proprio"], chunk(0, 1)["proprio"])
        pointers = {t.untyped_storage().data_ptr() for m in msgs for t in m.tensors.values()}
        assert len(pointers) >= 2 * len(msgs)  # large tensor + small-tensor buffer, per message


def test_every_dtype_crosses_a_real_socket_bit_exact(every_dtype_tensors):
    """Small tensors are rebuilt from the packed frame through numpy (bfloat16 by way of
    int16), large ones from their own frames: every dtype, an empty, a 0-d and a
    non-contiguous tensor come out with their bytes, dtype and shape."""
    tensors = dict(every_dtype_tensors, big=torch.arange(40000, dtype=torch.float32))  # 160 KB: own frame
    cfg = DataPlaneConfig(transport="ipc")
    with TrajectoryReceiver(cfg) as rx, TrajectorySender(rx.endpoints, cfg, sender_id="s") as tx:
        tx.send("rollout", tensors)
        got = rx.get(timeout=10).tensors
    assert list(got) == list(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), k


def test_on_done_waits_until_zeromq_has_let_go_of_the_tensors(tmp_path):
    """A message queued for a receiver that is not there yet still uses the tensor's
    memory: no ``on_done``, and ``flush`` times out. Once a receiver binds and takes the
    message, ``on_done`` runs (and the bytes it got are the ones sent)."""
    endpoints = {"host": "elsewhere", "ipc": f"ipc://{tmp_path}/rx.sock", "hb_ipc": f"ipc://{tmp_path}/hb.sock"}
    x = torch.full((1 << 20,), 7, dtype=torch.uint8)  # 1 MiB: a zero-copy frame
    done = []
    with TrajectorySender(endpoints, DataPlaneConfig(transport="ipc"), sender_id="s") as tx:
        tx.send("rollout", {"x": x}, on_done=lambda: done.append(1))
        with pytest.raises(zmq.NotDone):
            tx.flush(timeout_s=0.3)
        assert done == []
        pull = zmq.Context.instance().socket(zmq.PULL)
        pull.bind(endpoints["ipc"])
        frames = pull.recv_multipart()
        tx.flush(timeout_s=10)
        assert done == [1]
        assert bytes(frames[-1]) == bytes([7]) * (1 << 20)
        small_done = []
        tx.send("rollout", {"y": torch.ones(4)}, on_done=lambda: small_done.append(1))
        assert small_done == [1]  # nothing zero-copy: done at once
        pull.close(linger=0)


def _flood_proc(endpoints: dict, name: str, n: int, go) -> None:
    x = {"image": torch.zeros(256 << 10, dtype=torch.uint8), "step": torch.zeros(1)}
    with TrajectorySender(endpoints, DataPlaneConfig(transport="ipc", send_timeout_s=30), sender_id=name) as tx:
        tx.send("hello", {})
        go.wait(30)  # flood only once both senders are connected
        for i in range(n):
            tx.send("rollout", x, {"i": i})
        tx.flush()


def test_a_slow_consumer_takes_from_every_sender_in_turn():
    """Two senders flood a consumer that is slower than both (backpressure all the way):
    each must get its turn. (Receiving without letting libzmq process its commands first
    left the second sender's pipe off the fair-queue rotation: the first 60 messages came
    nearly all from one sender, and the other waited seconds in ``send``.)"""
    cfg = DataPlaneConfig(transport="ipc", recv_queue=2)
    go = CTX.Event()
    with TrajectoryReceiver(cfg) as rx:
        procs = [CTX.Process(target=_flood_proc, args=(rx.endpoints, f"s{k}", 60, go)) for k in range(2)]
        for p in procs:
            p.start()
        hello = {rx.get(timeout=60).sender for _ in range(2)}
        assert hello == {"s0", "s1"}
        go.set()
        order = []
        while len(order) < 120:
            msg = rx.get(timeout=30)
            assert msg is not None
            order.append(msg.sender)
            time.sleep(0.02)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    first = order[:60]  # both senders still had messages to send
    assert min(first.count("s0"), first.count("s1")) >= 20, first


def test_backpressure_blocks_sender_with_bounded_buffering():
    cfg = DataPlaneConfig(transport="ipc", send_hwm=1, recv_hwm=1, recv_queue=1, send_timeout_s=2.0,
                          heartbeat_s=0.2, peer_timeout_s=1.0)
    with TrajectoryReceiver(cfg) as rx:
        tx = TrajectorySender(rx.endpoints, cfg, sender_id="fast")
        sent = 0
        with pytest.raises(BackpressureTimeout):
            for i in range(100):
                tx.send("rollout", chunk(0, i))
                sent += 1
        # Only a handful fit in the queues and socket buffers; the rest waited.
        assert sent < 20, sent
        assert tx.counters.dropped["backpressure_timeout"] == 1
        # Blocked for longer than peer_timeout_s, yet its heartbeats kept it alive.
        assert rx.live_peers == ["fast"] and rx.dead_peers == []
        # Once the learner reads again, everything that was accepted arrives, in order.
        seqs = []
        while (msg := rx.get(timeout=2.0)) is not None:
            seqs.append(msg.seq)
        assert seqs == list(range(sent))
        tx.close()


def test_dead_sender_is_detected_within_timeout(store):
    cfg = DataPlaneConfig(transport="ipc", heartbeat_s=0.2, peer_timeout_s=1.5)
    with TrajectoryReceiver(cfg, store=store) as rx:
        proc = CTX.Process(target=_sender_proc, args=(store.port, 7, 1, "ipc", 60.0))
        proc.start()
        assert rx.get(timeout=60) is not None
        assert rx.live_peers == ["rollout7"]
        time.sleep(0.6)
        assert rx.dead_peers == []  # heartbeats keep an idle sender alive
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        t0 = time.monotonic()
        while rx.dead_peers != ["rollout7"] and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert rx.dead_peers == ["rollout7"] and rx.live_peers == []
        assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("hwm", [1, 8])
def test_curve_encryption_and_client_authorisation(tmp_path, hwm):
    """A listed client gets through under its key's name, an unlisted one is refused and
    counted; also with a receive HWM of 1 (behind a ZAP handler libzmq then delivered
    nothing: raised to 2)."""
    keys = tmp_path / "keys"
    allowed = tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    pub, sec = zmq.auth.create_certificates(str(keys), "client")
    os.replace(pub, allowed / "client.key")
    client_keys = zmq.auth.load_certificate(sec)
    cfg = DataPlaneConfig(transport="tcp", curve=True, curve_authorized_dir=str(allowed), send_timeout_s=2,
                          send_hwm=hwm, recv_hwm=hwm)
    with TrajectoryReceiver(cfg) as rx:
        assert "curve_public_key" in rx.endpoints
        with TrajectorySender(rx.endpoints, cfg, sender_id="client", client_keys=client_keys) as tx:
            tx.send("rollout", {"x": torch.ones(3)})
            msg = rx.get(timeout=10)
            assert msg is not None and msg.sender == "client"
        # An unknown client (fresh key pair) is refused by the authenticator.
        with TrajectorySender(rx.endpoints, cfg, sender_id="intruder") as tx:
            try:
                tx.send("rollout", {"x": torch.ones(3)})
            except BackpressureTimeout:
                pass
            assert rx.get(timeout=1.5) is None
        assert rx.counters.received == 1
        assert rx.counters.rejected["curve_auth"] >= 1


def test_bad_config_names_the_field():
    from planes.config import DataPlaneConfigError  # the plane's own error: it imports nothing from dvla

    with pytest.raises(DataPlaneConfigError, match=r"data_plane\.transport: expected one of 'auto', 'ipc', 'tcp'"):
        TrajectoryReceiver(DataPlaneConfig(transport="udp"))
    with pytest.raises(DataPlaneConfigError, match=r"data_plane\.heartbeat_s: must be > 0 and below peer_timeout_s"):
        TrajectorySender({}, DataPlaneConfig(heartbeat_s=10.0))


_REUSE_PROBE = """
import collections, resource, sys, torch
from planes.data import DataPlaneConfig, TrajectoryReceiver, TrajectorySender
if sys.argv[1] == "mapped":  # glibc's starting mmap threshold, pinned (this turns its dynamic rise off)
    import ctypes
    assert ctypes.CDLL(None).mallopt(-3, 128 << 10) == 1
cfg = DataPlaneConfig(transport="ipc", keep_receive_buffers=sys.argv[1] == "keep")
chunk = {"image": torch.zeros(32, 8, 3, 64, 64, dtype=torch.uint8), "proprio": torch.zeros(32, 8, 12)}
with TrajectoryReceiver(cfg) as rx, TrajectorySender(rx.endpoints, cfg, sender_id="s") as tx:
    held = collections.deque()
    for i in range(150):
        if i == 50:  # steady state from here on
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tx.send("rollout", chunk)
        held.append(rx.get(timeout=30))
        while len(held) > 1 + i % 5:  # a learner holding a few chunks at a time
            held.popleft()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 100)
"""


@pytest.mark.skipif(os.uname().sysname != "Linux" or "glibc" not in os.confstr("CS_GNU_LIBC_VERSION").lower(),
                    reason="malloc tuning is for glibc")
def test_receive_buffers_are_reused_instead_of_faulting_in_anew():
    """3 MB chunks through a receiver while the consumer holds a few at a time: with
    ``keep_receive_buffers`` (the default) ZeroMQ's receive buffers come from memory that is
    already mapped. The control maps every buffer afresh (malloc's starting mmap threshold,
    pinned), so its pages fault in message after message: that shows the probe can see the
    difference. glibc's unpinned defaults are not the control: their threshold rises or not
    depending on the order of frees (~60 faults per message here, ~0 in one CI run).
    Each mode runs in its own process: the settings are process-wide."""
    def faults_per_message(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", _REUSE_PROBE, mode], capture_output=True, text=True,
                             check=True, cwd=str(ROOT))
        return float(out.stdout.split()[-1])

    kept, mapped = faults_per_message("keep"), faults_per_message("mapped")
    pages = (32 * 8 * 3 * 64 * 64 + 32 * 8 * 12 * 4) / os.sysconf("SC_PAGE_SIZE")  # a message's, ~771
    # Here ~0.05 and ~770 faults per message; once in a full suite run 7.7 (the other processes'
    # churn): kept faults in at most 2% of a message's pages, the control at least half of them.
    assert kept < 0.02 * pages and mapped > 0.5 * pages, (kept, mapped, pages)


@pytest.mark.alone
def test_a_waiting_consumer_receives_itself_and_a_busy_one_finds_messages_prefetched():
    """While the consumer waits in get(), it reads the socket in its own thread; while it is
    busy elsewhere, the background thread fills the receive queue, in order."""
    cfg = DataPlaneConfig(transport="ipc", recv_queue=4)
    small = {"x": torch.arange(16)}
    with TrajectoryReceiver(cfg) as rx, TrajectorySender(rx.endpoints, cfg, sender_id="s") as tx:
        assert rx.get(timeout=0.01) is None  # nothing sent: the consumer's own receive times out
        seqs = []
        for i in range(50):  # the consumer is back in get() before each message arrives
            tx.send("rollout", small)
            seqs.append(rx.get(timeout=10).seq)
        # The thread takes one only if the consumer was away from get() for 2 ms (without
        # this design it took all 50).
        assert rx.counters.prefetched < 10, rx.counters.prefetched
        for i in range(6):  # the consumer is busy: the thread takes up to recv_queue of these
            tx.send("rollout", small)
        deadline = time.monotonic() + 10
        while rx.depth() < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rx.depth() == 4 and rx.counters.prefetched >= 4
        seqs += [rx.get(timeout=10).seq for _ in range(6)]  # 4 from the queue, then 2 from the socket
        assert seqs == list(range(56)) and rx.counters.received == 56


@pytest.mark.alone
def test_a_full_receive_queue_hands_over_as_soon_as_the_consumer_takes():
    """With ``recv_queue=1`` the receiver thread waits for room after nearly every message;
    it must wake when the consumer takes one, not sleep out a poll interval each time
    (it used to sleep up to 20 ms whenever the queue was full)."""
    cfg = DataPlaneConfig(transport="ipc", recv_queue=1)
    small = {"x": torch.arange(16)}
    with TrajectoryReceiver(cfg) as rx, TrajectorySender(rx.endpoints, cfg, sender_id="s") as tx:
        for i in range(5):
            tx.send("rollout", small)
            assert rx.get(timeout=10) is not None
        t0 = time.monotonic()
        for i in range(200):
            tx.send("rollout", small)
        for i in range(200):
            assert rx.get(timeout=10).seq == 5 + i
        assert time.monotonic() - t0 < 0.4  # here: ~0.04 s now, ~0.8 s with the old 20 ms waits


def test_socket_files_of_dead_processes_are_removed(tmp_path):
    """A killed run cannot remove its ipc:// socket directory (or, from older runs, socket
    files); the next receiver removes those whose process is gone and leaves those of live
    processes alone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"dvla-{dead.pid}-0123456789ab.sock"
    stale_dir = tmp_path / f"dvla-{dead.pid}-abcd1234"
    live = tmp_path / f"dvla-{os.getppid()}-0123456789ab.sock"
    other = tmp_path / "dvla-bench-0123.sock"
    for f in (stale, live, other):
        f.write_bytes(b"")
    stale_dir.mkdir()
    (stale_dir / "data.sock").write_bytes(b"")
    assert sorted(remove_stale_ipc_files(str(tmp_path))) == sorted([str(stale), str(stale_dir)])
    assert not stale.exists() and not stale_dir.exists() and live.exists() and other.exists()
    cfg = DataPlaneConfig(transport="ipc")
    with TrajectoryReceiver(cfg) as rx:  # its own directory is named after this process
        path = rx.endpoints["ipc"][len("ipc://"):]
        assert os.path.basename(os.path.dirname(path)).startswith(f"dvla-{os.getpid()}-") and os.path.exists(path)
    assert not os.path.exists(os.path.dirname(path))


def test_an_authorised_key_directory_without_keys_is_a_clear_error(tmp_path):
    from planes.config import DataPlaneConfigError

    (tmp_path / "empty").mkdir()
    for where in (tmp_path / "empty", tmp_path / "missing"):
        cfg = DataPlaneConfig(transport="tcp", curve=True, curve_authorized_dir=str(where))
        with pytest.raises(DataPlaneConfigError, match=r"data_plane.curve_authorized_dir: no public keys \(\*\.key\) "
                                                       r"in .*dvla keys"):
            TrajectoryReceiver(cfg)
