"""Two hosts with separate network stacks (network namespaces joined by a veth pair,
``tests/helpers/netns.py``, the ``two_hosts`` fixture): one ``torchrun --nnodes=2`` per host, c10d rendezvous on host a's
address. Chunks must cross the link over tcp to an address the learner advertised (not
loopback), weights must cross it down the hierarchical broadcast, the run must learn, and
the veth's byte counters must show the traffic; killed, one host's ranks restart and the
job resumes on both. Every process runs inside a namespace the
test made, so no packet can go anywhere else."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from tests.helpers.ranks import LineProcess, torchrun_workers

from dvla.metrics import read_metrics

pytestmark = pytest.mark.slow  # two torchrun agents and their ranks per test, in namespaces


def torchrun(host, hosts, port: int, out, *overrides: str, extra: tuple[str, ...] = ()) -> list[str]:
    rdzv = hosts.hosts[0].address
    return host.command([
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
        f"--rdzv_endpoint={rdzv}:{port}", "--rdzv_id=dvla-two-hosts", f"--local_addr={host.address}", *extra,
        "-m", "dvla.launch", "--preset", "fast_reach", "env.image_size=16", "env.n_envs=32",
        "swimlane.env_groups=1", "swimlane.chunks_per_update=2", "run.progress=false", "run.torch_threads=1", "run.tensorboard=false",
        f"run.out_dir={out.parent}", f"run.name={out.name}", *overrides])


def run_both(cmds: list[list[str]], cwd, timeout: float = 300) -> list[str]:
    """Each host's output, once both exited 0."""
    rcs, logs = launch_both(cmds, cwd, timeout)
    assert rcs == [0] * len(cmds), "\n=====\n".join(log[-6000:] for log in logs)
    return logs


def launch_both(cmds: list[list[str]], cwd, timeout: float = 300) -> tuple[list[int], list[str]]:
    """Each host's exit code and output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.getcwd()}
    env.pop("MASTER_ADDR", None), env.pop("MASTER_PORT", None)
    procs = [subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    deadline, logs = time.monotonic() + timeout, []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs.append(p.communicate()[0] + f"\n[killed after {timeout} s]")
    for p in procs[len(logs):]:
        logs.append(p.communicate()[0])
    return [p.returncode for p in procs], logs


def test_two_hosts_train_over_a_real_link(two_hosts, tmp_path):
    a, b = two_hosts.hosts
    out = tmp_path / "two_hosts"
    before = {h.netns: h.link_bytes() for h in two_hosts.hosts}
    port = random.randrange(20000, 30000)
    logs = run_both([torchrun(h, two_hosts, port, out, "run.iterations=30") for h in two_hosts.hosts], tmp_path)
    after = {h.netns: h.link_bytes() for h in two_hosts.hosts}
    # Without keys the job starts, with one warning (the one learner's) that names the risk
    # and the command that fixes it.
    warnings = [line for log in logs for line in log.splitlines() if "UNAUTHENTICATED" in line]
    assert len(warnings) == 1 and "dvla keys" in warnings[0] and "require_auth" in warnings[0], warnings

    s = {0: json.loads((out / "summary.json").read_text())}
    for r in (1, 2, 3):
        s[r] = json.loads((out / f"summary_rank{r}.json").read_text())
    hosts = {r: s[r]["host"] for r in s}
    assert set(hosts.values()) == {a.hostname, b.hostname} and hosts[0] == hosts[1] != hosts[2] == hosts[3]
    home = a if hosts[0] == a.hostname else b  # the host of rank 0 (the learner)
    other = b if home is a else a

    # Chunks: ipc on the learner's host, tcp across the link to the address the learner
    # advertised on it (its veth address, never loopback).
    routes = {r: s[r]["data_route"] for r in s}
    assert all(routes[r]["learner"] == 0 for r in s)
    for r in (0, 1):
        assert routes[r]["transport"] == "ipc"
    for r in (2, 3):
        assert routes[r]["transport"] == "tcp" and routes[r]["address"].startswith(f"tcp://{home.address}:")
        assert s[r]["chunks_sent"] > 0
    acc = s[0]["chunk_accounting"]
    assert acc["unaccounted"] == 0 and acc["rejected_invalid"] == 0
    # The learner's receiver refuses anything larger than this job's largest chunk (plus margin).
    assert 0 < s[0]["receiver"]["max_frame_bytes"] < s[0]["receiver"]["max_message_bytes"] < 4 << 20

    # Weights: once across the link per version (to the other host's leader), then locally.
    t = {r: s[r]["broadcast_traffic"] for r in s}
    versions = t[2]["inter_received"]
    assert versions > 0 and t[0]["inter_sent"] == versions
    assert t[2]["local_sent"] == versions == t[3]["local_received"]

    # The link carried it: at least the weights sent across and the chunks that crossed.
    rx_home = after[home.netns][0] - before[home.netns][0]
    tx_home = after[home.netns][1] - before[home.netns][1]
    assert tx_home >= t[0]["inter_sent_bytes"] > 0, (tx_home, t[0])
    assert rx_home > 100_000, rx_home  # chunks from the other host's two rollout ranks
    assert after[other.netns][1] - before[other.netns][1] >= rx_home * 0.9  # what the other end sent

    # Both hosts' ranks trained: the other host sampled, the learner learned.
    assert s[2]["chunks_sent"] + s[3]["chunks_sent"] > 0 and s[0]["version"] == 30
    success = [r["success_rate"] for r in read_metrics(out / "metrics.jsonl")]
    first, last = sum(success[:6]) / 6, sum(success[-6:]) / 6
    assert last > first + 0.2, (first, last)


def test_require_auth_without_keys_stops_each_host_with_one_line(two_hosts, tmp_path):
    """``data_plane.require_auth=true`` on two hosts and no keys: every rank refuses at its
    plan, before any socket or collective, and each host's log says why once, with the fix;
    no rank is reported lost, none prints a traceback of its own."""
    port = random.randrange(40000, 50000)
    rcs, logs = launch_both([torchrun(h, two_hosts, port, tmp_path / "no_keys", "data_plane.require_auth=true")
                             for h in two_hosts.hosts], tmp_path, timeout=120)
    text = "\n=====\n".join(log[-4000:] for log in logs)
    assert rcs == [1, 1], text  # torchrun's own code for failed workers (each exited 2, its table says)
    for log in logs:
        lines = [ln for ln in log.splitlines() if ln.startswith("dvla:")]
        assert "lost" not in log and "Failed to recv" not in log and log.count("Traceback") == 1, text
        assert "exitcode  : 2" in log and "exitcode  : 1" not in log, text
        assert len(lines) == 1 and "data_plane.require_auth" in lines[0] and "dvla keys" in lines[0], text
        assert "the chunks of rank(s) 2, 3 would cross tcp without authentication" in lines[0], lines[0]
    assert not (tmp_path / "no_keys").exists()  # a failed start leaves no run directory


def test_killing_one_hosts_ranks_restarts_and_resumes_across_both(two_hosts, tmp_path):
    """SIGKILL both ranks of host b mid-run: both agents restart their workers (c10d
    rendezvous), the job resumes from rank 0's last checkpoint on both hosts and finishes."""
    a, b = two_hosts.hosts
    out = tmp_path / "kill"
    port = random.randrange(30000, 40000)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.getcwd()}
    env.pop("MASTER_ADDR", None), env.pop("MASTER_PORT", None)
    logs = [open(tmp_path / f"{h.hostname}.log", "w") for h in two_hosts.hosts]
    procs = [subprocess.Popen(torchrun(h, two_hosts, port, out, "run.iterations=16", "run.save_every=1",
                                       extra=("--max-restarts=1", "--monitor-interval=0.5")),
                              cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
             for h, log in zip(two_hosts.hosts, logs)]
    killed: list[int] = []
    try:
        deadline = time.monotonic() + 240
        metrics = out / "metrics.jsonl"
        while not killed and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.2)
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
                killed = list(torchrun_workers(procs[1].pid).values())  # host b's agent's
                for pid in killed:
                    os.kill(pid, signal.SIGKILL)
        rcs = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    text = "\n=====\n".join((tmp_path / f"{h.hostname}.log").read_text()[-5000:] for h in two_hosts.hosts)
    assert len(killed) == 2, text
    assert rcs == [0, 0], text
    final = json.loads((out / "summary.json").read_text())
    assert final["restarts"] == 1 and final["resumed_from"] >= 4 and final["version"] == 16, final
    first = json.loads((out / "attempts" / "attempt0.json").read_text())
    assert first["stopped_early"]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["version"] for r in rows] == list(range(1, 17))  # one row per version, none repeated
    hosts = {json.loads((out / f"summary_rank{r}.json").read_text())["host"] for r in (1, 2, 3)} | {final["host"]}
    assert hosts == {a.hostname, b.hostname}  # the resumed attempt ran on both hosts
    assert final["chunk_accounting"]["unaccounted"] == 0


_RECEIVER = """
import json, sys, time
from planes.data import DataPlaneConfig, TrajectoryReceiver
cfg = DataPlaneConfig(transport="tcp", curve=True, curve_keys_dir=sys.argv[1], curve_authorized_dir=sys.argv[2])
with TrajectoryReceiver(cfg, peers_elsewhere=True, rendezvous=sys.argv[3]) as rx:
    print(json.dumps(rx.endpoints), flush=True)
    got, deadline = [], time.monotonic() + 60
    while len(got) < 3 and time.monotonic() < deadline:
        msg = rx.get(timeout=0.2)
        if msg is not None:
            got.append(msg.sender)
    sys.stdin.readline()  # the intruder has tried
    time.sleep(0.5)
    print(json.dumps({"got": got, "rejected": dict(rx.counters.rejected)}), flush=True)
"""

_SENDER = """
import json, sys, time
import torch
from planes.data import DataPlaneConfig, TrajectorySender
from planes.keys import load_client_keys
endpoints, keys, name = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
cfg = DataPlaneConfig(transport="tcp", curve=True, send_timeout_s=3.0)
tx = TrajectorySender(endpoints, cfg, sender_id=name, client_keys=load_client_keys(keys, name))
for i in range(int(sys.argv[4])):
    tx.send("chunk", {"x": torch.arange(10.0)}, {"i": i})
time.sleep(2.0)
tx.close()
"""


def test_curve_admits_a_listed_key_and_refuses_an_unlisted_one_across_hosts(two_hosts, tmp_path):
    """Receiver on host a admits only rank1's key (``dvla keys`` made it); a sender on host b
    with that key gets through, an intruder with a key of its own is refused and counted."""
    from planes.keys import make_keys

    a, b = two_hosts.hosts
    make_keys(tmp_path / "keys", ["rank0", "rank1"])
    make_keys(tmp_path / "other", ["rank1"])  # same name, another key: not listed
    (tmp_path / "keys" / "public" / "rank0.key").unlink()  # only rank1 is admitted
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with LineProcess(a.command([sys.executable, "-c", _RECEIVER, str(tmp_path / "keys"),
                                str(tmp_path / "keys" / "public"), b.address]), env=env) as rx:
        endpoints = rx.hello
        assert endpoints["tcp"].startswith(f"tcp://{a.address}:")
        ok = subprocess.run(b.command([sys.executable, "-c", _SENDER, json.dumps(endpoints), str(tmp_path / "keys"),
                                       "rank1", "3"]), env=env, capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        bad = subprocess.run(b.command([sys.executable, "-c", _SENDER, json.dumps(endpoints), str(tmp_path / "other"),
                                        "rank1", "1"]), env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 0, bad.stderr  # it cannot tell: its messages just never arrive
        result = rx.finish()
    assert result["got"] == ["rank1"] * 3
    assert result["rejected"].get("curve_auth", 0) >= 1, result


def test_learners_advertise_their_own_endpoints_and_listed_curve_keys_cross_the_link(two_hosts, tmp_path):
    """One job, two learners on host a and the rollout ranks on host b, every rank's key made
    by ``dvla keys`` (operator-supplied, a shared directory) and listed, with
    ``require_auth``. Each rollout rank dials its own learner's advertised endpoint over the
    link; chunks cross it encrypted and authenticated, each under its key's name, none
    refused, no warning; the learners stay identical and the run finishes."""
    subprocess.run([sys.executable, "-m", "dvla.cli", "keys", str(tmp_path / "keys"), "--ranks", "4"], check=True,
                   capture_output=True)
    out = tmp_path / "learners"
    curve = ("data_plane.curve=true", f"data_plane.curve_keys_dir={tmp_path / 'keys'}",
             f"data_plane.curve_authorized_dir={tmp_path / 'keys' / 'public'}", "data_plane.require_auth=true")
    port = random.randrange(50000, 60000)
    logs = run_both([torchrun(h, two_hosts, port, out, "run.iterations=6", "swimlane.learner_ranks=2",
                              "swimlane.colocate=false", *curve) for h in two_hosts.hosts], tmp_path)
    assert not any("UNAUTHENTICATED" in log for log in logs)
    s = {0: json.loads((out / "summary.json").read_text())}
    for r in (1, 2, 3):
        s[r] = json.loads((out / f"summary_rank{r}.json").read_text())
    home = s[0]["host"]
    home_address = next(h.address for h in two_hosts.hosts if h.hostname == home)
    learners = [r for r in s if s[r]["role"].startswith("learner")]
    assert learners == [0, 1] and s[1]["host"] == home != s[2]["host"]
    routes = {r: s[r]["data_route"] for r in (2, 3)}
    assert sorted(routes[r]["learner"] for r in (2, 3)) == [0, 1]
    addresses = {routes[r]["address"] for r in (2, 3)}
    assert len(addresses) == 2 and all(x.startswith(f"tcp://{home_address}:") for x in addresses)
    assert all(routes[r]["transport"] == "tcp" and s[r]["chunks_sent"] > 0 for r in (2, 3))
    for r in learners:
        assert s[r]["receiver"]["rejected"].get("curve_auth", 0) == 0, s[r]["receiver"]
        assert not s[r]["receiver"]["rejected"].get("spoofed_sender"), s[r]["receiver"]
    assert s[0]["weights_digest"] == s[1]["weights_digest"] and s[0]["version"] == 6
    assert s[0]["collective_sequence"] == s[1]["collective_sequence"]
