"""Run directories: every launch writes to a directory of its own under ``run.out_dir``,
``latest`` points to the newest, ``--resume`` finds it, ``dvla report`` / ``dvla trace``
without an argument take it. The end of a run is a short human summary; rank 0's INFO
logs (topology, placement) are shown. Real processes where it is CLI behaviour."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dvla.app import cli
from dvla.config import ConfigError
from dvla.metrics import TORN_LINE
from dvla.state.rundir import (LATEST, choose_run_dir, discard_new_run, find_latest_run, latest_run, new_run_dir,
                         resolve_run_arg)


def launch(*args, cwd, timeout=180, torchrun=0, launcher=None):
    """``python -m dvla.launch`` on the debug preset (forked by ``launcher``, tests/helpers/forks.py,
    where given), or under torchrun with ``torchrun`` ranks."""
    args = ["--preset", "debug", "run.torch_threads=1", "run.tensorboard=false", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if launcher is not None and not torchrun:
        proc = launcher.run("dvla.launch", args, cwd=cwd, timeout=timeout, env=env)
    else:
        pre = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"] \
            if torchrun else [sys.executable]
        proc = subprocess.run([*pre, "-m", "dvla.launch", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


# -- the directory logic -------------------------------------------------------------------------


def test_new_runs_get_unique_directories_and_latest_follows(tmp_path):
    base = tmp_path / "runs" / "x"
    a = new_run_dir(base, now=0.0)
    b = new_run_dir(base, now=0.0)  # the same second: a suffix
    c = new_run_dir(base, now=0.0)
    assert a.parent == base and b.name == f"{a.name}-2" and c.name == f"{a.name}-3"
    link = base / LATEST
    assert link.is_symlink() and os.readlink(link) == c.name  # relative
    assert latest_run(base) == c and resolve_run_arg(base) == c and resolve_run_arg(a) == a
    named = new_run_dir(base, name="exp1")
    assert named == base / "exp1" and latest_run(base) == named
    (named / "config.yaml").write_text("{}\n")
    with pytest.raises(ConfigError, match="run.name: .*exp1 already holds a run; continue it with --resume"):
        new_run_dir(base, name="exp1")


def test_resume_finds_the_run_to_continue(tmp_path):
    base = tmp_path / "b"
    with pytest.raises(ConfigError, match="--resume: no run to continue in"):
        choose_run_dir(base, resume=True)
    run, resumed = choose_run_dir(base)  # a fresh run
    assert not resumed and latest_run(base) == run
    assert choose_run_dir(base, resume=True) == (run, True)
    assert choose_run_dir(base, restarted=True) == (run, True)  # a torchrun restart continues it too
    # run.out_dir naming a run directory itself (it holds config.yaml or checkpoints/)
    (run / "checkpoints").mkdir()
    assert choose_run_dir(run, resume=True) == (run, True)
    # a named run
    assert choose_run_dir(base, name="n1")[0] == base / "n1"
    assert choose_run_dir(base, name="n1", resume=True) == (base / "n1", True)
    with pytest.raises(ConfigError, match="no run to continue in .*n2"):
        choose_run_dir(base, name="n2", resume=True)


def test_a_run_that_failed_to_start_leaves_nothing(tmp_path):
    base = tmp_path / "b"
    first = new_run_dir(base, name="first")
    second = new_run_dir(base, name="second")
    discard_new_run(base, second, previous=first)
    assert not second.exists() and latest_run(base) == first
    discard_new_run(base, first, previous=None)
    assert not first.exists() and not (base / LATEST).is_symlink()


def test_find_latest_run_under_runs(tmp_path):
    runs = tmp_path / "runs"
    assert find_latest_run(runs) is None
    old = new_run_dir(runs / "a", name="old")
    (old / "config.yaml").write_text("{}\n")
    legacy = runs / "legacy"  # a run written straight into its out_dir (older dvla, or Swimlane(cfg))
    legacy.mkdir()
    (legacy / "config.yaml").write_text("{}\n")
    os.utime(legacy / "config.yaml", (1, 1))
    os.utime(legacy, (1, 1))
    assert find_latest_run(runs) == old
    new = new_run_dir(runs / "b", name="new")
    (new / "config.yaml").write_text("{}\n")
    os.utime(old / "config.yaml", (2, 2))
    os.utime(old, (2, 2))
    assert find_latest_run(runs) == new


def test_report_without_an_argument_takes_the_latest_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = new_run_dir(Path("runs") / "debug")
    (run / "config.yaml").write_text("{}\n")
    seen = []
    import dvla.app.report.make

    monkeypatch.setattr(dvla.app.report.make, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["report", "--out", "rep"]) == 0
    assert seen[-1] == [str(run), "--out", "rep"]
    assert f"using the newest run, {run}" in capsys.readouterr().err
    assert cli.main(["report", "runs/debug"]) == 0  # a base directory: its latest run
    assert seen[-1] == [str(run)]
    assert cli.main(["report", "elsewhere/run"]) == 0  # anything else as given
    assert seen[-1] == ["elsewhere/run"]
    monkeypatch.chdir(tmp_path / "runs")  # no runs/ here
    assert cli.main(["trace"]) == 2
    assert "no run found under runs/" in capsys.readouterr().err


# -- real launches --------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_launches_two_directories_then_resume_and_trace_the_latest(tmp_path, launcher):
    first = launch("run.iterations=1", cwd=tmp_path, launcher=launcher)
    second = launch("run.iterations=1", cwd=tmp_path, launcher=launcher)
    base = tmp_path / "runs" / "debug"
    runs = sorted(p for p in base.iterdir() if p.name != LATEST)
    assert len(runs) == 2 and os.readlink(base / LATEST) == runs[1].name
    for proc, run in zip((first, second), runs):
        rel = f"runs/debug/{run.name}"
        lines = proc.stdout.strip().splitlines()
        summary = lines[-3:]  # the human summary: results, where they are, what to run next
        assert summary[0].startswith("done: 1 updates in ") and "final success rate" in summary[0] \
            and "env steps/s" in summary[0], lines
        assert summary[1].startswith(f"outputs: {rel}") and summary[2] == f"next:    dvla report {rel}"
        assert not any(ln.startswith("{") for ln in lines)  # the JSON summary is in summary.json only
        assert json.loads((run / "summary.json").read_text())["version"] == 1
        assert f"[dvla] run directory: {rel}" in proc.stderr

    with open(runs[1] / "metrics.jsonl", "a") as f:
        f.write('{"iter": 1, "lo')  # a crash mid-write (dvla sft's resume sees the same: test_sft_ranks.py)
    resumed = launch("--resume", "run.iterations=2", cwd=tmp_path, launcher=launcher)
    assert "(resumed from update 1)" in resumed.stdout and "continuing it" in resumed.stderr
    assert TORN_LINE.format(path=f"runs/debug/{runs[1].name}/metrics.jsonl", line=2) in resumed.stderr, resumed.stderr
    assert [json.loads(ln)["iter"] for ln in (runs[1] / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    summary = json.loads((runs[1] / "summary.json").read_text())
    assert summary["resumed_from"] == 1 and summary["version"] == 2
    assert len([p for p in base.iterdir() if p.name != LATEST]) == 2  # no new directory

    proc = launcher.run("dvla.cli", ["trace"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == f"dvla trace: using the newest run, runs/debug/{runs[1].name}"
    assert (runs[1] / "gantt.png").exists() and not (runs[0] / "gantt.png").exists()


@pytest.mark.slow
def test_torchrun_ranks_share_one_run_directory_and_rank0_logs_placement(tmp_path):
    """(Also tests/integration/test_trainer.py's torchrun launch with two processes: one job for both.)"""
    from dvla.metrics import read_metrics

    proc = launch("run.iterations=2", "run.out_dir=out", cwd=tmp_path, torchrun=2)
    runs = [p for p in (tmp_path / "out").iterdir() if p.name != LATEST]
    assert len(runs) == 1
    run = runs[0]
    rows = read_metrics(run / "metrics.jsonl")
    assert len(rows) == 2 and rows[-1]["world_size"] == 2
    assert (run / "summary.json").exists() and (run / "summary_rank1.json").exists()
    assert (run / "trace.json").exists() and (run / "trace_rank1.json").exists()
    err = proc.stderr
    assert err.count("[dvla] topology: 1 host, 2 ranks") == 1 and err.count("[dvla] placement:") == 1
    assert "[dvla rank 1]" not in err  # the other ranks log warnings only
    assert proc.stdout.count("next:    dvla report") == 1  # rank 0's summary only
    assert f"outputs: out/{run.name}" in proc.stdout


def test_verbose_is_exposed_to_the_simulators(monkeypatch, capsys):
    from dvla.app.train import main

    monkeypatch.delenv("DVLA_VERBOSE", raising=False)
    assert main(["--preset", "debug", "--print-config"]) == 0
    assert "DVLA_VERBOSE" not in os.environ
    assert main(["--preset", "debug", "--verbose", "--print-config"]) == 0
    assert os.environ["DVLA_VERBOSE"] == "1"
    assert "out_dir: runs/debug" in capsys.readouterr().out
