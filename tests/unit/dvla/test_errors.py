"""A user's mistake on the command line is one clear line on stderr and exit code 2, no
traceback (``--debug`` shows one). ``python -m dvla.launch`` / ``dvla`` processes of their own,
forked from one that imported torch once (tests/helpers/forks.py)."""

import os

import pytest

from dvla.app.cli import COMMANDS


@pytest.fixture
def launch(launcher):
    """``python -m dvla.launch`` (or ``module``) with ``args``, forked (tests/helpers/forks.py)."""
    def run(*args, cwd, module="dvla.launch", timeout=120):
        return launcher.run(module, list(args), cwd=cwd, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return run


def one_line_error(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("args, culprits", [
    # --print-config validates the policy's and the env's own options too, without building them
    (["--print-config", "policy.options.hiden_dim=3"], ["policy.options.hiden_dim", "hidden_dim"]),
    (["--print-config", "env.options.privilegd=true"], ["env.options.privilegd", "privileged"]),
    (["policy.name=tiny"], ["policy.name", "'tiny'", "tiny_vla"]),
    (["env.name=genesis_reech"], ["env.name", "'genesis_reech'", "genesis_reach", "fast_reach"]),
    (["run.iterations=0"], ["run.iterations", ">= 1"]),
    (["--config", "missing.yaml"], ["missing.yaml", "no such"]),
    (["--config", "bad.yaml"], ["bad.yaml:3:14", "invalid YAML"]),
    (["--config", "typo.yaml"], ["typo.yaml", "env.nenvs", "n_envs"]),
    (["--resume"], ["--resume", "runs/debug"]),
    (["--resume", "run.out_dir=ckptless"], ["--resume", "no checkpoint", "ckptless"]),
    (["--frobnicate"], ["--frobnicate"]),
    (["--preset", "nope"], ["'nope'", "fast_reach"]),
    # raised while the swimlane is built (after the config checks): still one line
    (["swimlane.learner_ranks=3"], ["swimlane.learner_ranks", "the world has 1"]),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path, launch, args, culprits):
    (tmp_path / "bad.yaml").write_text("env:\n  n_envs: 8\n   image_size: 16\n")
    (tmp_path / "typo.yaml").write_text("env:\n  nenvs: 8\n")
    (tmp_path / "ckptless").mkdir()
    (tmp_path / "ckptless" / "config.yaml").write_text("{}\n")  # a run directory without checkpoints
    line = one_line_error(launch("--preset", "debug", *args, cwd=tmp_path))
    assert line.startswith("dvla: error: "), line
    for c in culprits:
        assert c in line, (c, line)
    assert not (tmp_path / "runs" / "debug").exists() or not any((tmp_path / "runs" / "debug").iterdir()), \
        "a run that failed to start left a directory behind"


def test_debug_shows_the_traceback(tmp_path, launch):
    proc = launch("--preset", "debug", "--debug", "policy.name=tiny", cwd=tmp_path)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr and "unknown policy 'tiny'" in proc.stderr


def test_unknown_dvla_command(tmp_path, launch):
    line = one_line_error(launch("frobnicate", cwd=tmp_path, module="dvla.cli"))
    assert "unknown command 'frobnicate'" in line
    for cmd in COMMANDS:
        assert cmd in line


def test_dvla_help_lists_the_commands(tmp_path, launch):
    proc = launch("--help", cwd=tmp_path, module="dvla.cli")
    assert proc.returncode == 0
    for cmd, command in COMMANDS.items():  # one line each: the command and what it does
        assert any(ln.strip().startswith(f"dvla {cmd} ") and ln.endswith(command.what) for ln in proc.stdout.splitlines()), \
            (cmd, proc.stdout)
    assert "``" not in proc.stdout
