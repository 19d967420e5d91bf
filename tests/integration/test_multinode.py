"""Two "nodes" on one machine, as ``examples/multinode.sh --demo`` starts them: two torchrun
invocations joined by c10d rendezvous on loopback, each told it is a different host
(``DVLA_FAKE_HOSTNAME``). They train together; the run must show that weights went down the
hierarchical tree (once across the hosts, then fanned out locally) and that chunks took ipc
on a host and tcp across, and every rank must have built what ``--print-rank`` printed for it
beforehand. (The example's own test: one two-node job serves both.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dvla.metrics import read_metrics
from tests.helpers import ROOT


@pytest.mark.slow
def test_two_nodes_train_together_over_the_tree(tmp_path):
    job = ["run.iterations=30", "env.image_size=16", "env.n_envs=32", "swimlane.env_groups=1",
           "swimlane.chunks_per_update=2", "run.torch_threads=1", "run.tensorboard=false"]
    # The plans, printed without building anything, for the same job on two hosts of two ranks.
    printed = subprocess.run([sys.executable, "-m", "dvla.launch", "--preset", "fast_reach", *job,
                              "swimlane.topology=2x2", "--print-rank"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr[-3000:]
    plans = ["rank " + block for block in printed.stdout.strip().split("\nrank ")]
    plans[0] = plans[0].removeprefix("rank ")

    runs = tmp_path / "multinode"
    env = {**os.environ, "OUT_DIR": str(runs), "SAVE_EVERY": "10", "PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    demo = subprocess.run(["bash", str(ROOT / "examples" / "multinode.sh"), "--demo", *job], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    text = demo.stdout + demo.stderr
    assert demo.returncode == 0, text[-6000:]
    assert "[nodeA]" in text and "[nodeB]" in text and "demo: broadcast tree leaders [0, 2]" in text, text[-3000:]
    out = runs / "latest"  # the run's own directory under OUT_DIR
    # Rank 0 (on whichever node) logs the hosts and the placement, once; the others stay quiet.
    assert text.count("[dvla] topology: 2 hosts, 4 ranks") == 1 and text.count("[dvla] placement:") == 1, text[-6000:]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if (p / "manifest.json").exists())
    assert saved and set(saved) <= {"step-00000010", "step-00000020", "step-00000030"}, saved  # save_every=10

    s = {0: json.loads((out / "summary.json").read_text())}
    for r in (1, 2, 3):
        s[r] = json.loads((out / f"summary_rank{r}.json").read_text())
    # Two hosts of two ranks each, whichever agent got ranks 0-1.
    hosts = {s[r]["host"] for r in s}
    assert hosts == {"nodeA", "nodeB"} and s[0]["host"] == s[1]["host"] != s[2]["host"] == s[3]["host"]
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
