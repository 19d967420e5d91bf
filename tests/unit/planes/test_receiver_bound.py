"""How much memory a peer can make a learner's receiver hold (real processes, RSS read
from /proc). Measured with libzmq 4.3.5: a multipart message that never ends stays queued
at its sender, not at the receiver. With ``curve_authorized_dir`` a peer without a listed
key never gets past the handshake, whatever it sends. A frame above ``max_frame_bytes``
(a job sets it from its largest tensor) drops the connection before the receiver takes
it; without that limit the receiver has to take each such frame to refuse it."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.helpers.ranks import LineProcess

_RECEIVER = """
import json, os, sys, time
from planes.data import DataPlaneConfig, TrajectoryReceiver
args = json.loads(sys.argv[1])
cfg = DataPlaneConfig(transport="tcp", recv_hwm=1, **args)
with TrajectoryReceiver(cfg) as rx:  # nobody consumes: backpressure, as during a long update
    print(json.dumps({"endpoints": rx.endpoints, "pid": os.getpid()}), flush=True)
    sys.stdin.readline()
    print(json.dumps({"rejected": dict(rx.counters.rejected), "received": rx.counters.received}), flush=True)
"""

_ATTACKER = """
import json, sys, time, zmq
endpoint, frame_mb, more, curve_key = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
ctx = zmq.Context()
s = ctx.socket(zmq.PUSH)
s.setsockopt(zmq.LINGER, 0)
if curve_key:
    s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()  # a key of its own: not listed
    s.curve_serverkey = curve_key.encode()
s.connect(endpoint)
frame, sent, t0 = b"x" * (frame_mb << 20), 0, time.monotonic()
while sent < (400 << 20) and time.monotonic() - t0 < 4:
    try:
        s.send(frame, (zmq.SNDMORE if more else 0) | zmq.NOBLOCK)
        sent += len(frame)
    except zmq.Again:
        time.sleep(0.005)
time.sleep(1.0)
print(sent >> 20, flush=True)
"""


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096 / (1 << 20)


def attack(receiver_args: dict, frame_mb: int, multipart: bool, tmp_path) -> dict:
    with LineProcess([sys.executable, "-c", _RECEIVER, json.dumps(receiver_args)], cwd=tmp_path) as rx:
        hello = rx.hello
        time.sleep(0.5)
        before = rss_mb(hello["pid"])
        key = hello["endpoints"].get("curve_public_key", "")
        out = subprocess.run([sys.executable, "-c", _ATTACKER, hello["endpoints"]["tcp"], str(frame_mb),
                              "1" if multipart else "0", key], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        grown = rss_mb(hello["pid"]) - before
        result = rx.finish()
    return {"sent_mb": int(out.stdout), "grown_mb": grown, **result}


def test_an_unfinished_multipart_message_is_not_buffered_by_the_receiver(tmp_path):
    got = attack({}, frame_mb=1, multipart=True, tmp_path=tmp_path)
    assert got["sent_mb"] >= 200 and got["grown_mb"] < 30 and got["received"] == 0, got


def test_an_unlisted_peer_cannot_make_the_receiver_hold_memory(tmp_path):
    from planes.keys import make_keys

    make_keys(tmp_path / "keys", ["rank0"])
    got = attack({"curve": True, "curve_authorized_dir": str(tmp_path / "keys" / "public")}, frame_mb=1,
                 multipart=True, tmp_path=tmp_path)
    assert got["grown_mb"] < 30, got
    assert got["received"] == 0 and got["rejected"].get("curve_auth", 0) >= 1


def test_a_frame_above_the_limit_is_dropped_before_the_receiver_takes_it(tmp_path):
    limited = attack({"max_message_bytes": 1 << 20, "max_frame_bytes": 1 << 20}, frame_mb=8, multipart=False,
                     tmp_path=tmp_path)
    assert limited["sent_mb"] >= 8 and limited["grown_mb"] < 40, limited
    assert limited["received"] == 0 and limited["rejected"] == {}, limited  # libzmq dropped them
    unlimited = attack({}, frame_mb=8, multipart=False, tmp_path=tmp_path)
    assert sum(unlimited["rejected"].values()) >= 1, unlimited  # taken in, then refused


def test_a_job_bounds_its_receiver_by_its_largest_chunk():
    """The limits a job derives from its specs hold a real chunk, and not much more."""
    import torch

    from dvla.envs import make_env
    from dvla.policy import PolicySpec, build_policy
    from dvla.config.presets import debug
    from dvla.rollout import collect_episodes
    from planes.serial import encode
    from swimlane.lanes.validate import ChunkSpec

    cfg = debug()
    env = make_env(cfg.env, torch.device("cpu"), seed=0)
    policy = build_policy(cfg.policy.name, PolicySpec.for_env(env.spec, cfg.policy.action_chunk), cfg.policy.options)
    spec = ChunkSpec.for_policy(policy, cfg.env.n_envs, cfg.env.episode_len)
    max_msg, max_frame = spec.message_limits()
    frames = encode("chunk", collect_episodes(env, policy, cfg.env.episode_len).to_dict(), {"sender": "r", "seq": 0})
    size = sum(len(memoryview(f)) for f in frames)
    assert size <= max_msg <= 2 * size + (128 << 10)
    assert max(len(memoryview(f)) for f in frames[1:]) <= max_frame < max_msg
