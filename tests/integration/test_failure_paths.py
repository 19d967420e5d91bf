"""Issue #38, "lose nothing on disk": failure paths that must neither lose nor hide what a
run wrote (a start-up failure, a poisoned policy, NaN weights, a resume after a crash, a
torn metrics line, a changed config, a lost rank, a long trace, a preemption)."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dvla.app import run as app_run, train as launch
from dvla.state.checkpoint import CheckpointManager
from dvla.config import ConfigError, apply_overrides
from dvla.config.presets import debug
from dvla.state.rundir import latest_run, new_run_dir, point_latest
from dvla.metrics import truncate_metrics
from swimlane.observation.trace import Tracer


@pytest.fixture
def launch_proc(launcher):
    """``python -m dvla.launch ARGS`` in ``cwd``, forked (tests/helpers/forks.py)."""
    def run(*args, cwd, timeout=180):
        return launcher.run("dvla.launch", list(args), cwd=cwd, timeout=timeout,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return run


def one_line(proc, code=2) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("dvla:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def fake_checkpoint(run: Path, version: int, cfg=None) -> None:
    cfg = cfg or debug()
    CheckpointManager(run / "checkpoints").save(version, {"x": torch.zeros(1)},
                                                {"version": version, "config": cfg.to_dict()})


# -- 1: a start-up failure --------------------------------------------------------------------


def test_a_startup_failure_discards_the_new_run_and_resume_takes_the_newest_with_a_checkpoint(
        tmp_path, monkeypatch, caplog):
    base = tmp_path / "runs"
    old = new_run_dir(base, name="old")
    fake_checkpoint(old, 2)

    class Boom:
        def __init__(self, *a, **k):
            raise RuntimeError("the simulator would not start")

    import swimlane

    monkeypatch.setattr(swimlane, "Swimlane", Boom)
    cfg = apply_overrides(debug(), [f"run.out_dir={base}"])
    args = SimpleNamespace(verbose=False, debug=False)
    with pytest.raises(RuntimeError, match="simulator"):
        launch.train(args, cfg)
    assert sorted(p.name for p in base.iterdir()) == ["latest", "old"], "an empty run directory was left behind"
    assert latest_run(base) == old

    # latest points at a run without checkpoints (one that crashed after writing its config):
    # --resume takes the newest run that has one, and says which
    newer = new_run_dir(base, name="newer")
    (newer / "config.yaml").write_text("{}\n")
    point_latest(base, newer)
    cfg = apply_overrides(debug(), [f"run.out_dir={base}", "run.resume=true"])
    logging.getLogger("dvla").addHandler(caplog.handler)  # train() gave dvla a handler of its own
    with caplog.at_level(logging.INFO, logger="dvla"):
        got = app_run.share_run_dir(cfg.run.out_dir, cfg, 0, 1, 0)
    assert got.path == old and got.resumed
    assert any("old" in r.getMessage() and "checkpoint" in r.getMessage() for r in caplog.records), caplog.text


# -- 2: every chunk rejected; senders of non-finite updates -------------------------------------


def _lane(monkeypatch, items, algo=None, check=None, stall_s=600.0, senders=()):
    from swimlane.observation.health import StallTimer, check_stall
    from swimlane.lanes import gradient as L
    from swimlane.observation.ledger import Ledger

    if check is not None:
        monkeypatch.setattr(L, "check_chunk", check)
    monkeypatch.setattr(L, "concat", lambda chunks: chunks[0])
    it = iter(items)
    source = SimpleNamespace(get=lambda timeout=0.0: next(it, None))
    ledger = Ledger()
    return L.GradientLane(source=source, algo=algo, generator=None, ledger=ledger, tracer=Tracer(False),
                         cfg=L.GradientConfig(need=1, max_staleness=4, iterations=100, stop_rollouts_before_last=False,
                                             spec=object() if check else None, poll_s=0.0, senders=senders),
                         version=lambda: 0, finish_update=lambda u: False,
                         check_health=lambda stall: check_stall(stall, ledger.counts, 0),
                         stall=StallTimer(stall_s))


def _chunk():
    return SimpleNamespace(valid=torch.ones(2, 2, dtype=torch.bool), num_envs=2,
                           policy_version=torch.zeros(2, 2, dtype=torch.long))


def test_a_policy_whose_every_chunk_is_rejected_stops_soon_and_says_why(monkeypatch):
    import threading

    items = ((_chunk(), {"rank": 1}, None) for _ in range(2000))
    # (the stall timer, 600 s by default, is 20 s here: the test's bound without the fix)
    lane = _lane(monkeypatch, items, check=lambda b, s, v: ("non_finite", "actions holds NaN or inf"), stall_s=20.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        lane.collect(threading.Event())
    assert time.monotonic() - t0 < 30
    msg = str(err.value)
    assert "every chunk" in msg and "rejected" in msg and "actions holds NaN" in msg and "1" in msg, msg


def test_a_sender_whose_every_chunk_is_rejected_is_cut_off_and_the_others_go_on(monkeypatch):
    """rank1's chunks are all poison, rank2's are fine: rank1 is cut off (its later chunks
    dropped and counted, the log naming it, never rank2), rank2's chunks keep being
    consumed, and the run stops only once rank2 is cut off too, naming both senders."""
    import threading

    poison = {"rank1"}

    def check(batch, spec, version):
        return ("non_finite", "rewards holds NaN or inf") if batch.who in poison else None

    def chunk(who):
        c = _chunk()
        c.who = who
        return c, {"rank": int(who[-1]), "sender": who}, None

    items = [chunk("rank1") for _ in range(100)] + [chunk("rank2") for _ in range(3)]
    items += [chunk("rank1") for _ in range(20)] + [chunk("rank2")]
    lane = _lane(monkeypatch, iter(items), check=check, senders=("rank1", "rank2"))
    for _ in range(4):
        assert lane.collect(threading.Event()) is not None  # rank2's four chunks, one per update
    assert set(lane.cut_off) == {"rank1"} and "rewards holds NaN" in lane.cut_off["rank1"]
    assert lane.ledger["rejected_non_finite"] == 64 and lane.ledger["rejected_cut_off"] == 100 + 20 - 64
    poison.add("rank2")
    more = iter([chunk("rank2") for _ in range(64)])
    lane.source.get = lambda timeout=0.0: next(more, None)
    with pytest.raises(RuntimeError, match="every sender is cut off") as err:
        lane.collect(threading.Event())
    assert "rank1: its last 64" in str(err.value) and "rank2: its last 64" in str(err.value), err.value


def test_non_finite_updates_name_the_chunks_senders(monkeypatch):
    import threading

    algo = SimpleNamespace(update=lambda *a, **k: {"non_finite_steps": 1.0})
    items = [(_chunk(), {"rank": r}, None) for r in (3, 5, 3, 5, 3)]
    lane = _lane(monkeypatch, items, algo=algo)
    with pytest.raises(RuntimeError, match="max_bad_updates") as err:
        lane.run(threading.Event())
    assert "3" in str(err.value).split("sent by")[1] and "5" in str(err.value).split("sent by")[1], err.value


# -- 3, 4: NaN weights are not written; every attempt is kept ---------------------------------


def test_nan_weights_are_not_written_and_the_last_good_version_is_named(tmp_path, caplog):
    from swimlane import Swimlane

    out = tmp_path / "run"
    lanes = None

    def poison(record):
        if record["version"] == 2:
            with torch.no_grad():
                for p in lanes.policy.parameters():
                    p.fill_(float("nan"))

    lanes = Swimlane(apply_overrides(debug(), [f"run.out_dir={out}", "run.iterations=6", "run.save_every=1"]),
                     on_update=poison)
    with caplog.at_level(logging.WARNING, logger="dvla"), pytest.raises(Exception, match="NaN"):
        lanes.run()
    weights = out / "weights.safetensors"
    if weights.exists():
        from safetensors.torch import load_file

        assert all(torch.isfinite(t).all() for t in load_file(str(weights)).values() if t.is_floating_point())
    assert "last good version 1" in caplog.text, caplog.text
    for ck in CheckpointManager(out / "checkpoints").list():  # no checkpoint holds NaN weights either
        t = CheckpointManager(out / "checkpoints").load(ck).tensors
        assert all(torch.isfinite(v).all() for k, v in t.items() if k.startswith("policy/")), ck


def test_resume_keeps_every_attempt(tmp_path):
    from swimlane import Swimlane

    out = tmp_path / "run"
    Swimlane(apply_overrides(debug(), [f"run.out_dir={out}", "run.iterations=2", "run.save_every=1"])).run()
    Swimlane(apply_overrides(debug(), [f"run.out_dir={out}", "run.iterations=3", "run.resume=true"])).run()
    attempts = sorted(p.name for p in (out / "attempts").iterdir())
    assert attempts == ["attempt0.json", "attempt1.json"], attempts
    assert json.loads((out / "attempts" / "attempt0.json").read_text())["version"] == 2
    assert json.loads((out / "attempts" / "attempt1.json").read_text())["version"] == 3


# -- 5: a torn metrics line ---------------------------------------------------------------------


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iter": 0}\n{"iter": 1}\n{"iter": 2}\n{"iter": 3, "lo')
    truncate_metrics(path, 3)
    assert [json.loads(ln)["iter"] for ln in path.read_text().splitlines()] == [0, 1, 2]


# -- 6: resume compares the config with the checkpoint's ----------------------------------------


def test_resume_refuses_what_cannot_continue_and_logs_what_changed():
    from dvla.state.rundir import check_resume_config

    old = debug().to_dict()

    def new(*overrides):
        return apply_overrides(debug(), list(overrides)).to_dict()

    for refused in (["env.n_envs=16"], ["policy.action_chunk=3"], ["policy.options.hidden_dim=64"],
                    ["algo.name=ppo"], ["env.image_size=24"]):
        with pytest.raises(ConfigError, match=refused[0].split("=")[0].replace(".", r"\.")):
            check_resume_config(old, new(*refused), done=2)
    with pytest.raises(ConfigError, match=r"run\.iterations.*2"):
        check_resume_config(old, new("run.iterations=2"), done=2)
    changed = check_resume_config(old, new("run.iterations=9", "run.time_limit_s=60", "run.progress=false",
                                           "run.out_dir=elsewhere"), done=2)
    keys = [c.split(":")[0] for c in changed]
    assert "run.iterations" in keys and "run.time_limit_s" in keys and "run.out_dir" not in keys, changed
    assert check_resume_config(old, new(), done=2) == []


@pytest.mark.slow
def test_resume_with_another_env_count_is_one_line(tmp_path, launch_proc):
    first = launch_proc("--preset", "debug", "run.iterations=2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    config = (tmp_path / "runs" / "debug" / "latest" / "config.yaml").read_text()
    line = one_line(launch_proc("--preset", "debug", "--resume", "env.n_envs=16", "run.iterations=4", cwd=tmp_path))
    assert "env.n_envs" in line and "resume" in line, line
    assert (tmp_path / "runs" / "debug" / "latest" / "config.yaml").read_text() == config
    line = one_line(launch_proc("--preset", "debug", "--resume", "run.iterations=1", cwd=tmp_path))
    assert "run.iterations" in line, line


@pytest.mark.slow
def test_no_valid_checkpoint_is_one_line_naming_those_tried_on_one_rank_and_three(tmp_path, launch_proc):
    """Issue #47, 6: every checkpoint's tensors truncated, then ``--resume``: one line, exit 2,
    naming each checkpoint tried and what is wrong with it (no traceback, no "skipping" line
    per checkpoint). On three ranks under torchrun the same line once, and every rank exits
    2 or is stopped by torchrun: the ranks that lose rank 0 know it left over a mistake and
    say nothing."""
    first = launch_proc("--preset", "debug", "run.iterations=2", "run.save_every=1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = sorted((tmp_path / "runs" / "debug" / "latest" / "checkpoints").iterdir())
    for ck in checkpoints:
        (ck / "tensors.safetensors").write_bytes(b"\0" * 100)
    line = one_line(launch_proc("--preset", "debug", "--resume", "run.save_every=1", cwd=tmp_path))
    assert "no valid checkpoint" in line and all(f"{ck.name}: tensors.safetensors" in line for ck in checkpoints), line
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                           "-m", "dvla.launch", "--preset", "debug", "--resume", "run.save_every=1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("dvla")]
    assert [ln for ln in lines if "error" in ln] == [line], proc.stderr[-4000:]
    # torchrun's table: rank 0 exits 2, and no rank reports a failure of its own (the others
    # exit 2 quietly, or torchrun has stopped them first)
    assert "exitcode  : 2" in proc.stderr and "exitcode  : 1" not in proc.stderr, proc.stderr[-4000:]


def test_a_start_that_fails_leaves_no_run_directory_and_latest_where_it_was(tmp_path, launch_proc):
    """Issue #47, 5: a status endpoint that cannot be served fails the start after the run's
    directory was made and written to (config, metrics file, attempt): one line, exit 2, and
    the directory is gone, ``latest`` still at the run before."""
    first = launch_proc("--preset", "debug", "run.iterations=1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    base = tmp_path / "runs" / "debug"
    before = sorted(p.name for p in base.iterdir())
    latest = (base / "latest").resolve()
    line = one_line(launch_proc("--preset", "debug", "run.status_port=0", "run.status_host=999.1.1.1", cwd=tmp_path))
    assert "run.status_host" in line, line
    assert sorted(p.name for p in base.iterdir()) == before and (base / "latest").resolve() == latest


# -- 7: device, encoding, a directory that cannot be written ----------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line(tmp_path, launch_proc):
    line = one_line(launch_proc("--preset", "debug", "run.device=cuda", cwd=tmp_path))
    assert "run.device" in line and "CUDA" in line, line


def test_a_yaml_file_that_is_not_utf8_is_one_line(tmp_path, launch_proc):
    (tmp_path / "bad.yaml").write_bytes(b"env:\n  n_envs: 8 # \xff\xfe caf\xe9\n")
    line = one_line(launch_proc("--preset", "debug", "--config", "bad.yaml", cwd=tmp_path))
    assert "bad.yaml" in line and "UTF-8" in line, line


def test_an_output_directory_that_cannot_be_written_is_one_line(tmp_path, launch_proc):
    line = one_line(launch_proc("--preset", "debug", "run.out_dir=/proc/sys", cwd=tmp_path))
    assert "run.out_dir" in line and "/proc/sys" in line, line


# -- 8: a lost rank -----------------------------------------------------------------------------


def test_a_lost_rank_is_one_line_with_what_to_run_next(tmp_path, monkeypatch, capsys):
    import swimlane

    class Lost:
        def __init__(self, *a, **k):
            raise RuntimeError("rollout rank(s) 2 stopped sending heartbeats for 10s (data_plane.peer_timeout_s): "
                               "crashed or hung.\nmore detail")

    monkeypatch.setattr(swimlane, "Swimlane", Lost)
    monkeypatch.setattr(launch, "init_from_env", lambda **k: (1, 3))
    monkeypatch.setattr(launch, "share_run_dir", lambda *a: app_run.RunDir(tmp_path, False, None))

    def leave(code):
        raise SystemExit(code)

    monkeypatch.setattr(app_run, "abandon", leave)
    with pytest.raises(SystemExit):
        launch.train(SimpleNamespace(verbose=False, debug=False), apply_overrides(debug(), []))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("dvla:")]
    assert len(lines) == 1 and "rank 2" in lines[0] and "--resume" in lines[0], err


def test_a_group_that_cannot_be_made_is_one_line_from_the_hosts_first_rank(monkeypatch, capsys):
    """What ``init_from_env`` refuses before any group exists (ranks that would share a GPU
    under NCCL, dvla/distributed/groups.py): every rank of the host finds it, local rank 0 says it."""
    from dvla.distributed.groups import check_one_gpu_each

    def refuse(**kwargs):
        check_one_gpu_each("cpu:gloo,cuda:nccl", {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                                                  "CUDA_VISIBLE_DEVICES": "0"})

    monkeypatch.setattr(launch, "init_from_env", refuse)
    for local in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", local)
        assert launch.train(SimpleNamespace(verbose=False, debug=False), apply_overrides(debug(), [])) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        lines = [ln for ln in err.strip().splitlines() if ln.startswith("dvla:")]
        assert len(lines) == (local == "0") and all("would share one GPU" in ln for ln in lines), err


# -- 9: a bounded trace window ------------------------------------------------------------------


def test_the_trace_keeps_the_newest_spans_and_says_once_that_older_ones_were_dropped(caplog):
    tr = Tracer(True, max_spans=10)
    with caplog.at_level(logging.WARNING, logger="dvla"):
        for i in range(25):
            tr.add("gradient", "learn", float(i), float(i) + 0.5)
    held = [round(s[2] + tr.t0) for s in tr.spans]
    assert 10 <= len(held) <= 12 and held == list(range(25 - len(held), 25)), held  # the newest, in order
    assert json.loads(json.dumps(tr.spans)) == [list(s) for s in list(tr.spans)]
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1, caplog.text


def test_autotune_reads_on_past_the_trace_window():
    from swimlane.adaptation.autotune import LaneClock

    tr = Tracer(True, max_spans=10)
    clock = LaneClock(tr)
    busy = 0.0
    for i in range(100):
        tr.add("gradient", "learn", float(i), float(i) + 0.5)
        if i % 7 == 0:
            busy += clock.busy().get("gradient", 0.0)
    busy += clock.busy().get("gradient", 0.0)
    assert busy == pytest.approx(50.0)  # every span counted once


# -- 10: preemption -----------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_exits_0_and_resume_continues(tmp_path, launch_proc):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dvla.launch", "--preset", "debug", "run.iterations=100000",
                             "run.save_every=0"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "runs" / "debug" / "latest" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (out[-2000:], err[-3000:])
    assert "--resume" in out + err, (out, err)
    cks = CheckpointManager(tmp_path / "runs" / "debug" / "latest" / "checkpoints").list()
    assert cks, (out, err)
    done = int(cks[-1].name.split("-")[1])
    assert done >= 3
    resumed = launch_proc("--preset", "debug", "--resume", f"run.iterations={done + 2}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert [r["iter"] for r in rows] == list(range(done + 2)), [r["iter"] for r in rows]
