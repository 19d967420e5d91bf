"""The ``dvla`` command: subcommands, help, and the benchmark launcher."""

import subprocess
import sys

import pytest

from dvla.app.bench import BENCH_DIR
from dvla.app.cli import COMMANDS, main


def test_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for cmd in COMMANDS:
        assert f"dvla {cmd}" in text
    assert main(["nonsense"]) == 2


@pytest.mark.slow
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


def test_plan_takes_a_registered_policys_parameter_count(capsys):
    """``--params token_vla:size=7b``: the named size's count (built on the meta device)."""
    pytest.importorskip("transformers")
    from dvla.app.plan import policy_params

    count = int(policy_params(["--nodes", "8", "--params", "token_vla:size=7b"])[-1])
    assert 6.5e9 < count < 7.5e9
    assert int(policy_params(["--params=token_vla:size=0.5b"])[0].split("=")[1]) < 1e9
    assert main(["plan", "--nodes", "1,16", "--params", "token_vla:size=7b"]) == 0
    assert "copies hier" in capsys.readouterr().out
    assert main(["plan", "--params", "no_such_policy"]) == 2
    assert "--params no_such_policy: policy.name: unknown policy" in capsys.readouterr().err


def test_keys_makes_one_persistent_keypair_per_rank(tmp_path, capsys):
    from planes.keys import load_client_keys

    assert main(["keys", str(tmp_path / "k"), "--ranks", "3"]) == 0
    assert "data_plane.curve_keys_dir=" in capsys.readouterr().out
    secret = sorted(p.name for p in (tmp_path / "k" / "secret").iterdir())
    assert secret == ["rank0.key_secret", "rank1.key_secret", "rank2.key_secret"]
    assert sorted(p.name for p in (tmp_path / "k" / "public").iterdir()) == ["rank0.key", "rank1.key", "rank2.key"]
    assert (tmp_path / "k" / "secret" / "rank1.key_secret").stat().st_mode & 0o077 == 0  # only its owner reads it
    first = load_client_keys(tmp_path / "k", "rank1")
    assert main(["keys", str(tmp_path / "k"), "--ranks", "4"]) == 0  # existing keys are kept
    assert load_client_keys(tmp_path / "k", "rank1") == first and len(first[1]) == 40
    with pytest.raises(Exception, match=r"data_plane.curve_keys_dir: no key for rank9 in .* make them with `dvla keys "):
        load_client_keys(tmp_path / "k", "rank9")
