"""Two "nodes" on one machine: two torchrun invocations joined by c10d rendezvous on
loopback, each told it is a different host (``DVLA_FAKE_HOSTNAME``). They train
together; the run must show that weights went down the hierarchical tree (once across
the hosts, then fanned out locally) and that chunks took ipc on a host and tcp across, and
every rank must have built what ``--print-rank`` printed for it beforehand."""

import json
import os
import socket
import subprocess
import sys

import pytest

from dvla.metrics import read_metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_train_together_over_the_tree(tmp_path):
    out = tmp_path / "two_nodes"
    port = free_port()
    job = ["--preset", "fast_reach", "run.iterations=30", "env.image_size=16", "env.n_envs=32",
           "swimlane.env_groups=1", "swimlane.chunks_per_update=2", "run.progress=false", "run.torch_threads=1"]
    # The plans, printed without building anything, for the same job on two hosts of two ranks.
    printed = subprocess.run([sys.executable, "-m", "dvla.launch", *job, "swimlane.topology=2x2", "--print-rank"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr[-3000:]
    plans = ["rank " + block for block in printed.stdout.strip().split("\nrank ")]
    plans[0] = plans[0].removeprefix("rank ")
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
               "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
               "--rdzv_id=dvla-two-nodes", "-m", "dvla.launch", *job, f"run.out_dir={out.parent}",
               f"run.name={out.name}"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "DVLA_FAKE_HOSTNAME": f"node{node}"}
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n=====\n".join(log[-6000:] for log in logs)
    # Rank 0 (on whichever node) logs the hosts and the placement, once; the others stay quiet.
    text = "\n".join(logs)
    assert text.count("[dvla] topology: 2 hosts, 4 ranks") == 1 and text.count("[dvla] placement:") == 1, text[-6000:]
    assert text.count(f"outputs: {out}") == 1

    s = {0: json.loads((out / "summary.json").read_text())}
    for r in (1, 2, 3):
        s[r] = json.loads((out / f"summary_rank{r}.json").read_text())
    # Two hosts of two ranks each, whichever agent got ranks 0-1.
    hosts = {s[r]["host"] for r in s}
    assert hosts == {"node0", "node1"} and s[0]["host"] == s[1]["host"] != s[2]["host"] == s[3]["host"]
    # What each rank built and ran is what --print-rank printed for it (the host names aside:
    # the topology's host0 is the host of ranks 0-1, here whichever agent got them).
    assert len(plans) == 4, printed.stdout
    for r in s:
        built = s[r]["built"].strip().replace(f" on {s[r]['host']}:", f" on host{r // 2}:", 1)
        assert built == plans[r].strip() == s[r]["plan"].strip().replace(f" on {s[r]['host']}:", f" on host{r // 2}:", 1), \
            (r, built, plans[r])
    tree = s[0]["placement"]["tree"]
    assert tree["leaders"] == [0, 2] and tree["local_groups"] == [[0, 1], [2, 3]]

    # Weights: rank 0 sent each version across the hosts once (to leader 2), which
    # forwarded it to rank 3; rank 1 got it on its own host from rank 0.
    t = {r: s[r]["broadcast_traffic"] for r in s}
    versions = t[2]["inter_received"]
    assert versions > 0 and t[0]["inter_sent"] == versions and t[0]["inter_sent_bytes"] == t[2]["inter_received_bytes"]
    assert t[2]["local_sent"] == versions == t[3]["local_received"]
    assert t[1]["local_received"] == versions and t[0]["local_sent"] == versions
    for r in (1, 3):
        assert not any(k.startswith("inter") for k in t[r])

    # Chunks: everything goes to learner 0, over ipc from its own host and tcp from the other.
    routes = {r: s[r]["data_route"] for r in s}
    assert all(routes[r]["learner"] == 0 for r in s)
    for r in (0, 1):
        assert routes[r]["transport"] == "ipc" and routes[r]["address"].startswith("ipc://")
    for r in (2, 3):
        assert routes[r]["transport"] == "tcp" and routes[r]["address"].startswith("tcp://")
        assert s[r]["chunks_sent"] > 0

    # And they learned together.
    rows = read_metrics(out / "metrics.jsonl")
    assert s[0]["version"] == 30 and len(rows) == 30
    success = [r["success_rate"] for r in rows]
    first, last = sum(success[:6]) / 6, sum(success[-6:]) / 6
    assert last > first + 0.2, (first, last)
