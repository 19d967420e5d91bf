"""The ``dvla`` command: subcommands, help, and the benchmark launcher."""

import subprocess
import sys

from dvla.cli import BENCH_DIR, COMMANDS, main


def test_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for cmd in COMMANDS:
        assert f"dvla {cmd}" in text
    assert main(["nonsense"]) == 2


def test_bench_lists_the_scripts_and_runs_one(capsys):
    assert main(["bench"]) == 0
    listing = capsys.readouterr().out
    for script in BENCH_DIR.glob("*.py"):
        assert script.stem in listing
    assert main(["bench", "no_such_bench"]) == 2
    # A real run through the console script: the planner part of the scaling bench is
    # instant, so run memory_churn (a few seconds) with few iterations.
    proc = subprocess.run([sys.executable, "-m", "dvla.cli", "bench", "memory_churn", "--iters", "20"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pool/plain" in proc.stdout


def test_plan_prints_the_model(capsys):
    assert main(["plan", "--nodes", "1,16", "--params", "1B"]) == 0
    out = capsys.readouterr().out
    assert "copies hier" in out and "alpha" in out
