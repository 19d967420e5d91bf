"""Trust nothing on the wire (issue #38): a sender's name comes from its connection, never
from its envelope; heartbeats, ``end`` and counts only change the records of the peer
that sent them, and counts must be plausible; finite but absurd values are rejected
before any update; on one host the data plane listens on no tcp port and its ipc
directory is closed to other users; with CurveZMQ a key is a name.

Every spoof below runs against a live receiver (real ZeroMQ connections); each passed on
the code before #38 was addressed, where the attack worked."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import stat
import subprocess
import time

import pytest
import torch
import zmq
import zmq.auth

from planes.config import DataPlaneConfigError
from planes.data import DataPlaneConfig, TrajectoryReceiver, TrajectorySender
from planes.serial import encode
from swimlane.lanes.chunks import END_KIND, RemoteChunkSource
from swimlane.observation.health import check_senders
from swimlane.observation.ledger import Ledger

CTX = mp.get_context("spawn")
FAST = dict(heartbeat_s=0.1, peer_timeout_s=1.5)


def _raw(endpoint: str) -> zmq.Socket:
    """An intruder's plain PUSH connection (same user, so it can open the ipc directory)."""
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def _until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def _drain(source, seconds: float = 1.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        source.get(timeout=0.1)


def _sender_proc(endpoints: dict, name: str) -> None:
    with TrajectorySender(endpoints, DataPlaneConfig(**FAST), sender_id=name) as tx:
        tx.send("hello", {})
        time.sleep(600)  # heartbeats until frozen or killed


def test_a_spoofed_end_cannot_hide_a_frozen_rank():
    """Another connection says ``end`` for rank2: rejected and counted, so when rank2 then
    freezes (SIGSTOP) its silence is flagged within ``peer_timeout_s``."""
    with TrajectoryReceiver(DataPlaneConfig(**FAST)) as rx:
        source = RemoteChunkSource(rx)
        proc = CTX.Process(target=_sender_proc, args=(rx.endpoints, "rank2"), daemon=True)
        proc.start()
        try:
            msg = rx.get(timeout=30)
            assert msg is not None and msg.sender == "rank2"
            intruder = _raw(rx.endpoints["ipc"])
            intruder.send_multipart(encode(END_KIND, {}, {"sender": "rank2", "seq": 0, "chunks": 0}))
            _drain(source)
            assert "rank2" not in source.ended
            assert rx.counters.rejected["spoofed_sender"] == 1
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=r"rank\(s\) rank2 stopped sending heartbeats"):
                while time.monotonic() - t0 < 10:
                    check_senders(["rank2"], source.ended, rx.dead_peers, 1.5, lambda: {})
                    time.sleep(0.05)
            assert time.monotonic() - t0 < 5
            intruder.close()
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)


def test_a_spoofed_heartbeat_changes_no_records():
    """Heartbeats claiming rank1 from another connection, and an implausible ``sent`` from a
    connection under its own name, are rejected: nobody's count reaches 10**12."""
    with TrajectoryReceiver(DataPlaneConfig(**FAST)) as rx, \
            TrajectorySender(rx.endpoints, DataPlaneConfig(**FAST), sender_id="rank1") as tx:
        for _ in range(2):
            tx.send("hello", {})
        assert rx.get(timeout=10) is not None and rx.get(timeout=10) is not None
        time.sleep(0.5)  # rank1's heartbeats have come
        intruder = _raw(rx.endpoints["hb_ipc"])
        intruder.send_multipart(encode("_hb", {}, {"sender": "rank1", "seq": -1, "sent": 10**12}))
        intruder.send_multipart(encode("_hb", {}, {"sender": "mallory", "seq": -1, "sent": 10**12}))
        assert _until(lambda: sum(rx.counters.rejected.values()) >= 2, 5)
        time.sleep(0.3)
        assert rx.reported_sent == {"rank1": 2}
        assert rx.counters.rejected["spoofed_sender"] == 1 and rx.counters.rejected["implausible_count"] == 1
        assert "mallory" not in rx.live_peers
        intruder.close()


def test_a_receiver_that_knows_its_senders_admits_no_other_name():
    """Issue #47, 1: heartbeats under three new names, each claiming 1,000 chunks sent (under
    the in-flight ceiling, so plausible), and a chunk under a fourth: with the job's senders
    known, each is rejected as ``unknown_sender`` before it is bound or recorded; only rank1
    owns a record."""
    cfg = DataPlaneConfig(**FAST)
    with TrajectoryReceiver(cfg, senders=["rank1"]) as rx, \
            TrajectorySender(rx.endpoints, cfg, sender_id="rank1") as tx:
        source = RemoteChunkSource(rx)
        tx.send("chunk", {"x": torch.ones(2)})
        hb, data = _raw(rx.endpoints["hb_ipc"]), _raw(rx.endpoints["ipc"])
        ghosts = [_raw(rx.endpoints["hb_ipc"]) for _ in range(3)]  # (kept: a closed socket drops what it holds)
        for i, ghost in enumerate(ghosts):
            ghost.send_multipart(encode("_hb", {}, {"sender": f"ghost{i}", "seq": -1, "sent": 1000}))
        data.send_multipart(encode("chunk", {"x": torch.ones(2)}, {"sender": "evil0", "seq": 0, "rank": 1}))
        assert _until(lambda: (source.get(timeout=0.05), rx.counters.rejected["unknown_sender"] >= 4)[1], 10), \
            rx.counters.rejected
        tx.send(END_KIND, {}, {"chunks": 1})
        assert _until(lambda: (source.get(timeout=0.1), "rank1" in source.ended)[1], 10)
        assert set(rx.reported_sent) == {"rank1"} and set(rx.live_peers) <= {"rank1"}
        acc = source.accounting(Ledger().counts, expected=["rank1"])
        assert acc["sent"] == 1 and acc["unaccounted"] == 0, acc
        assert not rx.peers.data.owner_of.keys() - {"rank1"}  # no name was bound
        for ghost in ghosts:
            ghost.close()
        hb.close()
        data.close()


def test_a_spoofed_chunk_name_cannot_poison_the_accounting():
    """Junk stamped ``sender=rank1, seq=10**15`` from another connection, or from its own
    name, changes no count: the accounting stays exact (nothing near 1e15, nothing
    negative in flight)."""
    with TrajectoryReceiver(DataPlaneConfig(**FAST)) as rx, \
            TrajectorySender(rx.endpoints, DataPlaneConfig(**FAST), sender_id="rank1") as tx:
        source = RemoteChunkSource(rx)
        for _ in range(3):
            tx.send("chunk", {"x": torch.ones(2)})
        intruder = _raw(rx.endpoints["ipc"])
        time.sleep(0.2)
        intruder.send_multipart(encode("chunk", {"x": torch.ones(2)}, {"sender": "rank1", "seq": 10**15}))
        intruder.send_multipart(encode("chunk", {"x": torch.ones(2)}, {"sender": "mallory", "seq": 10**15}))
        _drain(source, 2.0)
        tx.send(END_KIND, {}, {"chunks": 3})
        assert _until(lambda: (source.get(timeout=0.1), "rank1" in source.ended)[1], 10)
        acc = source.accounting(Ledger().counts, expected=["rank1"])
        assert acc["sent"] == 3 and acc["in_flight_at_exit"] == 0, acc
        assert rx.reported_sent == {"rank1": 4}  # three chunks and the end
        assert rx.counters.rejected["spoofed_sender"] == 1 and rx.counters.rejected["implausible_count"] == 1
        intruder.close()


def test_an_end_cannot_claim_more_chunks_than_its_sender_sent():
    with TrajectoryReceiver(DataPlaneConfig(**FAST)) as rx, \
            TrajectorySender(rx.endpoints, DataPlaneConfig(**FAST), sender_id="rank1") as tx:
        source = RemoteChunkSource(rx)
        tx.send("chunk", {"x": torch.ones(2)})
        tx.send(END_KIND, {}, {"chunks": 10**15})
        assert _until(lambda: (source.get(timeout=0.1), "rank1" in source.ended)[1], 10)
        assert source.ended == {"rank1": 1} and rx.counters.rejected["invalid_chunk"] == 2  # the junk chunk, the end


def test_a_connection_cannot_claim_a_second_name():
    """The first name a connection claims is its name for good; a name taken by one
    connection cannot be claimed by another."""
    with TrajectoryReceiver(DataPlaneConfig(**FAST)) as rx:
        a, b = _raw(rx.endpoints["ipc"]), _raw(rx.endpoints["ipc"])
        a.send_multipart(encode("hello", {}, {"sender": "rank3", "seq": 0}))
        assert rx.get(timeout=10).sender == "rank3"
        a.send_multipart(encode("hello", {}, {"sender": "rank4", "seq": 1}))
        b.send_multipart(encode("hello", {}, {"sender": "rank3", "seq": 1}))
        b.send_multipart(encode("hello", {}, {"sender": "rank5", "seq": 0}))
        msg = rx.get(timeout=10)
        assert msg is not None and msg.sender == "rank5"
        assert rx.get(timeout=0.5) is None
        assert rx.counters.received == 2 and rx.counters.rejected["spoofed_sender"] == 2
        a.close(), b.close()


def _listening_tcp_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        inodes |= {cols[9] for cols in map(str.split, lines) if cols[3] == "0A"}  # LISTEN
    return inodes


def _my_socket_inodes() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


_CONNECT_AS_NOBODY = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("refused")
else:
    print("connected")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_single_host_receiver_binds_no_tcp_port_and_its_ipc_directory_is_closed():
    """Defaults, every sender on this host (what a one-host job builds): ipc only, no
    listening tcp socket, and another user cannot even reach the socket files."""
    before = _listening_tcp_inodes() & _my_socket_inodes()
    with TrajectoryReceiver(DataPlaneConfig(), peers_elsewhere=False) as rx:
        assert not any(k.endswith("tcp") for k in rx.endpoints), rx.endpoints
        assert _listening_tcp_inodes() & _my_socket_inodes() == before
        path = rx.endpoints["ipc"][len("ipc://"):]
        mode = os.stat(os.path.dirname(path)).st_mode
        assert stat.S_IMODE(mode) == 0o700 and os.stat(os.path.dirname(path)).st_uid == os.getuid()

        def as_nobody():
            os.setgid(65534)
            os.setgroups([])
            os.setuid(65534)

        out = subprocess.run(["/usr/bin/env", "python3", "-c", _CONNECT_AS_NOBODY, path], preexec_fn=as_nobody,
                             capture_output=True, text=True, timeout=30, cwd="/")
        assert out.stdout.strip() == "refused", out
        assert rx.counters.received == 0 and not rx.counters.rejected


def test_peers_on_other_hosts_get_a_tcp_endpoint():
    with TrajectoryReceiver(DataPlaneConfig(), peers_elsewhere=True, rendezvous="127.0.0.1") as rx:
        assert rx.endpoints["tcp"].startswith("tcp://127.0.0.1:") and "ipc" in rx.endpoints


def _keys(tmp_path, *names):
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir(exist_ok=True), allowed.mkdir(exist_ok=True)
    out = {}
    for name in names:
        pub, sec = zmq.auth.create_certificates(str(keys), name)
        os.replace(pub, allowed / f"{name}.key")
        out[name] = zmq.auth.load_certificate(sec)
    return allowed, out


def test_curve_refuses_an_unlisted_key_and_counts_nothing_it_sends(tmp_path):
    """Without a listed key a process never gets past the handshake: none of its chunks
    or heartbeats reach any record. A listed key is its name: claiming another is refused."""
    allowed, keys = _keys(tmp_path, "rank1", "rank2")
    cfg = DataPlaneConfig(transport="tcp", curve=True, curve_authorized_dir=str(allowed), send_timeout_s=1, **FAST)
    with TrajectoryReceiver(cfg) as rx:
        with TrajectorySender(rx.endpoints, cfg, sender_id="rank1") as tx:  # a key of its own
            try:
                tx.send("chunk", {"x": torch.ones(2)})
            except Exception:  # noqa: BLE001  (backpressure: nothing is taken)
                pass
            assert rx.get(timeout=1.5) is None
        assert rx.counters.received == 0 and rx.counters.rejected["curve_auth"] >= 1
        assert rx.live_peers == [] and rx.reported_sent == {}
        with TrajectorySender(rx.endpoints, cfg, sender_id="rank2", client_keys=keys["rank1"]) as tx:
            tx.send("chunk", {"x": torch.ones(2)})
            assert rx.get(timeout=3) is None
        assert rx.counters.rejected["spoofed_sender"] >= 1 and "rank2" not in rx.reported_sent
        with TrajectorySender(rx.endpoints, cfg, sender_id="rank2", client_keys=keys["rank2"]) as tx:
            tx.send("chunk", {"x": torch.ones(2)})
            msg = rx.get(timeout=10)
            assert msg is not None and msg.sender == "rank2"


def test_require_auth_refuses_tcp_without_keys_and_the_warning_names_the_fix(caplog):
    with pytest.raises(DataPlaneConfigError, match=r"data_plane.require_auth: .*without authentication.*dvla keys"):
        TrajectoryReceiver(DataPlaneConfig(transport="tcp", require_auth=True))
    with caplog.at_level(logging.WARNING, logger="dvla.planes.data"):
        with TrajectoryReceiver(DataPlaneConfig(transport="tcp", bind_host="0.0.0.0")):
            pass
    warnings = [r.getMessage() for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]
    assert len(warnings) == 1 and "dvla keys" in warnings[0] and "require_auth" in warnings[0], warnings
    # Issue #47, 7: a tcp port on loopback is open to every user of the host: the same warning,
    # and the same refusal.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dvla.planes.data"):
        with TrajectoryReceiver(DataPlaneConfig(transport="tcp", bind_host="127.0.0.1")) as rx:
            assert any(v.startswith("tcp://127.0.0.1:") for v in rx.endpoints.values()), rx.endpoints
    warnings = [r.getMessage() for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]
    assert len(warnings) == 1 and "any user on this host" in warnings[0] and "transport=ipc" in warnings[0], warnings
    with pytest.raises(DataPlaneConfigError, match="require_auth"):
        TrajectoryReceiver(DataPlaneConfig(transport="tcp", bind_host="127.0.0.1", require_auth=True))


ABSURD = {
    "reward 3e38": ("rewards", 3e38, "rewards in"),
    "log-prob -1e30": ("log_probs", -1e30, "algo.max_abs_log_prob"),
    "value 1e30": ("values", 1e30, "algo.max_abs_value"),
}


@pytest.mark.parametrize("what", list(ABSURD))
def test_finite_but_absurd_values_are_rejected_before_any_update(tmp_path, what, caplog):
    """Finite values pass the NaN/inf check; a reward of 3e38 overflowed PPO's returns and
    three such chunks stopped the run. Now each is rejected (``rejected_range``), the log
    names the sender and the reason, and no update is spoiled."""
    from tests.helpers.ranks import rewire
    from tests.unit.swimlane.test_poison import Poisoner, _set, cfg_for

    from swimlane import Swimlane

    name, value, reason = ABSURD[what]
    lanes = Swimlane(cfg_for(tmp_path, "run", "algo.name=ppo", "policy.options.value_head=true",
                             "swimlane.max_bad_updates=2"))
    chunks = Poisoner(lanes.parts.source, _set(name, lambda t: torch.full_like(t, value)))
    rewire(lanes, sink=chunks, source=chunks)
    with caplog.at_level(logging.ERROR, logger="dvla"):
        summary = lanes.run()
    assert summary["version"] == 4 and summary["rejected_range"] == 4, summary
    assert summary["updates_non_finite"] == 0
    assert all(bool(torch.isfinite(p).all()) for p in lanes.policy.parameters())
    logged = [r.getMessage() for r in caplog.records if "rejected a chunk" in r.getMessage()]
    assert logged and "mallory" in logged[0] and "range" in logged[0] and reason in logged[0], logged


def test_an_env_declares_its_reward_range_and_a_bad_one_is_refused():
    from dvla.config import ConfigError
    from dvla.envs.base import DEFAULT_REWARD_RANGE, EnvSpec

    assert EnvSpec((3, 2, 2), 1, 1).reward_range == DEFAULT_REWARD_RANGE
    for bad in ((1.0, 0.0), (0.0, float("inf")), (float("nan"), 1.0), (0.0,)):
        with pytest.raises(ConfigError, match="EnvSpec.reward_range"):
            EnvSpec((3, 2, 2), 1, 1, reward_range=bad)


@pytest.mark.slow
def test_a_default_single_host_job_receives_on_ipc_only(tmp_path):
    """A real two-rank job on one host (torchrun, defaults): the learner's receiver listens
    on its ipc directory and on no tcp port, nothing is rejected, no warning."""
    import json
    import sys

    out = tmp_path / "one_host"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dvla.launch",
           "--preset", "debug", "run.torch_threads=1", "run.tensorboard=false", "run.iterations=3", "swimlane.colocate=false",
           f"run.out_dir={out.parent}", f"run.name={out.name}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    lines = [line for line in proc.stderr.splitlines() if "data plane: receiving on" in line]
    assert len(lines) == 1 and "ipc://" in lines[0] and "tcp://" not in lines[0], lines
    assert "UNAUTHENTICATED" not in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["version"] == 3 and not summary["receiver"]["rejected"], summary["receiver"]
    assert json.loads((out / "summary_rank1.json").read_text())["data_route"]["transport"] == "ipc"
