"""Plugins: a user's policy and env reach ``python -m dvla.launch``, ``torchrun`` and the
``dvla`` command through ``--import`` or through entry points of an installed package,
with no wrapper script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dvla.metrics import read_metrics
from tests.helpers import ROOT

REPO = ROOT

PLUGIN = '''
import logging

from dvla.envs import register_env
from dvla.models.tiny_vla import TinyVLA
from dvla.policy import register_policy


@register_policy("plugged_vla")
class PluggedVLA(TinyVLA):
    """TinyVLA under another name: enough to prove the registry was filled."""


class EntryVLA(TinyVLA):
    """Registered by its entry point's name, not by a decorator."""


def make_env(cfg, device, seed):
    from dvla.envs import ENV_REGISTRY
    return ENV_REGISTRY["fast_reach"](cfg, device, seed)


logging.basicConfig(level=logging.INFO)  # a library that configures the root logger (lerobot does)
'''


@pytest.fixture
def plugin_dir(tmp_path):
    """A package ``myplug`` and the metadata of an installed distribution declaring its
    entry points, both on PYTHONPATH."""
    (tmp_path / "myplug").mkdir()
    (tmp_path / "myplug" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    info = tmp_path / "myplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dvla.policies]\nentry_vla = myplug:EntryVLA\n\n"
                                           "[dvla.envs]\nentry_env = myplug:make_env\n")
    return tmp_path


def run(cmd, cwd, extra_path, timeout=240):
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(extra_path), str(REPO)])}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_an_imported_policy_trains_under_torchrun(plugin_dir, tmp_path):
    out = tmp_path / "runs"
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                "dvla.launch", "--import", "myplug", "--preset", "debug", "policy.name=plugged_vla",
                "run.iterations=2", f"run.out_dir={out}", "run.name=p", "run.torch_threads=1"], tmp_path, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(read_metrics(out / "p" / "metrics.jsonl")) == 2
    assert "name: plugged_vla" in (out / "p" / "config.yaml").read_text()
    assert json.loads((out / "p" / "summary_rank1.json").read_text())["chunks_sent"] > 0  # rank 1 ran it too


def test_entry_points_register_without_any_flag(plugin_dir, tmp_path):
    """... and dvla's log lines come once each, in its format, though the plugin configured the
    root logger (``logging.basicConfig``)."""
    out = tmp_path / "runs"
    proc = run([sys.executable, "-m", "dvla.launch", "--preset", "debug", "policy.name=entry_vla",
                "env.name=entry_env", "run.iterations=2", f"run.out_dir={out}", "run.name=e"], tmp_path, plugin_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((out / "e" / "summary.json").read_text())["version"] == 2
    said = [ln for ln in proc.stderr.splitlines() if "run directory:" in ln]
    assert said == [f"[dvla] run directory: {out / 'e'}"] and "INFO:dvla" not in proc.stderr, proc.stderr


def test_an_import_error_says_its_root_cause(tmp_path, capsys):
    """transformers re-raises a failed lazy import as ``Could not import module 'LlamaConfig'``;
    the cause (say, a torchvision build that does not match torch) is what to fix."""
    from dvla.app.cli import main
    from dvla.config import ConfigError
    from dvla.plugins import import_plugin

    plugin = tmp_path / "chained.py"
    plugin.write_text(textwrap.dedent('''
        def load():
            raise RuntimeError("operator torchvision::nms\\ndoes not exist")
        try:
            try:
                load()
            except RuntimeError as exc:
                raise RuntimeError("Failed to import transformers.models.llama") from exc
        except RuntimeError:
            raise ModuleNotFoundError("Could not import module 'LlamaConfig'")
    '''))
    want = (f"--import {plugin}: ModuleNotFoundError: Could not import module 'LlamaConfig' "
            "(root cause: RuntimeError: operator torchvision::nms does not exist)")
    with pytest.raises(ConfigError) as err:
        import_plugin(str(plugin))
    assert str(err.value) == want and "dvla_plugin_chained" not in sys.modules
    assert main(["check-policy", "--import", str(plugin)]) == 2
    assert capsys.readouterr().err == f"dvla check-policy: error: {want}\n"


def test_a_file_import_and_the_dvla_command(plugin_dir, tmp_path):
    example = REPO / "examples" / "custom_policy.py"
    proc = run([sys.executable, "-m", "dvla.launch", "--import", str(example), "--preset", "fast_reach",
                "policy.name=patch_mix_vla", "--print-config"], tmp_path, plugin_dir)
    assert proc.returncode == 0 and "name: patch_mix_vla" in proc.stdout, proc.stderr
    proc = run([sys.executable, "-m", "dvla.cli", "train", "--import", "myplug", "--preset", "debug",
                "policy.name=plugged_vla", "--print-config"], tmp_path, plugin_dir)
    assert proc.returncode == 0 and "name: plugged_vla" in proc.stdout, proc.stderr


def test_a_broken_plugin_is_a_one_line_error(plugin_dir, tmp_path):
    (plugin_dir / "broken.py").write_text("raise RuntimeError('the plugin is broken')\n")
    proc = run([sys.executable, "-m", "dvla.launch", "--import", "broken", "--preset", "debug"], tmp_path, plugin_dir)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "dvla: error: --import broken: RuntimeError: the plugin is broken"
    proc = run([sys.executable, "-m", "dvla.launch", "--import", "no_such_module", "--preset", "debug"], tmp_path,
               plugin_dir)
    assert proc.returncode == 2 and "--import no_such_module: ModuleNotFoundError" in proc.stderr
