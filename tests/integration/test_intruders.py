"""A same-user intruder against a running 3-rank job (issue #47, 1 and 2): connections under
names the job does not have own no records and blame no rank.

The intruder does what any process of the job's user can: it finds the learner's ipc sockets
(in the job's temporary directory) and connects to them. While the job runs it sends
heartbeats under three new names, each claiming 1,000 chunks sent, and poisoned chunks (a
reward of 3e38) under a fourth that also claims to be rank 1 in the chunk's metadata, then
lets the job run to its end (each learning pass waits 100 ms: 40 updates outlast the attack)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import zmq

from planes.serial import encode


def _status(run: Path) -> dict | None:
    try:
        url = (run / "status_address").read_text().strip()
        with urllib.request.urlopen(f"{url}/status", timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _until(cond, proc, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, f"the job ended while waiting for {what}"
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_unknown_senders_own_no_records_and_their_poison_blames_no_rank(tmp_path):
    out = tmp_path / "job"
    sockets = Path(tempfile.mkdtemp(prefix="dvla-t-"))  # short: an ipc path has at most 107 bytes
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           "-m", "dvla.launch", "--preset", "debug", "run.torch_threads=1", "run.tensorboard=false",
           "swimlane.colocate=false", "run.iterations=40", "run.status_port=0",
           "policy.options.learn_wait_ms=100", f"run.out_dir={tmp_path}", f"run.name={out.name}"]
    log = open(tmp_path / "job.log", "w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(sockets)})
    ctx = zmq.Context()
    try:
        _until(lambda: (_status(out) or {}).get("version", 0) >= 1, proc, "the first update")
        ipc = _until(lambda: list(sockets.glob("dvla-*/hb.sock")), proc, "the learner's sockets")
        assert len(ipc) == 1, ipc  # one learner
        folder = ipc[0].parent
        pushes = []
        for name in ("hb", "hb", "hb", "data"):
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 1000)
            s.connect(f"ipc://{folder / name}.sock")
            pushes.append(s)
        for i, s in enumerate(pushes[:3]):
            s.send_multipart(encode("_hb", {}, {"sender": f"ghost{i}", "seq": -1, "sent": 1000}))
        poison = {"rewards": torch.full((4, 2), 3e38)}
        for seq in range(5):
            pushes[3].send_multipart(encode("chunk", poison, {"sender": "evil0", "seq": seq, "rank": 1}))
        seen = _until(lambda: (st := _status(out)) and st["data_plane_rejected"].get("unknown_sender", 0) >= 8
                      and st, proc, "the rejections")
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        ctx.destroy(linger=0)
        shutil.rmtree(sockets, ignore_errors=True)
    text = (tmp_path / "job.log").read_text()
    assert rc == 0, text[-4000:]
    assert seen["data_plane_rejected"]["unknown_sender"] == 8, seen["data_plane_rejected"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["version"] == 40
    rollouts = [json.loads((out / f"summary_rank{r}.json").read_text()) for r in (1, 2)]
    acc = summary["chunk_accounting"]
    # Only ranks 1 and 2 own records: what was sent is what they sent, nobody died.
    assert acc["sent"] == sum(r["totals"]["chunks_sent"] for r in rollouts), (acc, [r["totals"] for r in rollouts])
    assert acc["lost_dead_peer"] == 0 and acc["unaccounted"] == 0, acc
    assert summary["receiver"]["rejected"]["unknown_sender"] == 8, summary["receiver"]
    assert not any(v for k, v in summary["totals"].items() if k.startswith("rejected_")), summary["totals"]
    assert "rejected a chunk from rank" not in text, text[-3000:]  # nothing blamed on a rank
    assert "was lost" not in text and "were lost" not in text, text[-3000:]
    assert "evil0" in text or "ghost" in text  # the rejections are logged, naming the connections' claims
