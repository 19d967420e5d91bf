"""The documentation: the configuration reference in docs/configuration.md is generated from
the config dataclasses and must match them (every config field carries its own
documentation); the site in docs/ builds without a warning; the README stays a short front
page with the two commands."""

import dataclasses
import re
import subprocess
import sys

import pytest

from dvla.app.cli import main as cli
from dvla.config import JobConfig
from dvla.app.config_ref import env_option_rows, full_reference
from dvla.config.reference import BEGIN, DOC_PAGE, END, field_docs, rows, write
from tests.helpers import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIG_PAGE = DOCS / "configuration.md"


def test_config_reference_is_current():
    assert DOC_PAGE == CONFIG_PAGE
    text = CONFIG_PAGE.read_text()
    assert BEGIN in text and "dvla config-ref --write docs/configuration.md" in BEGIN
    assert full_reference() in text, "docs/configuration.md is out of date: run `dvla config-ref --write`"


def test_every_option_of_every_shipped_env_is_declared_and_listed():
    """Each env declares its options (default, type and bounds, what it does) and the
    reference lists them with what they take (issue #47, 5)."""
    from dvla.envs.fast import FastReachEnv
    from dvla.envs.genesis_env import GenesisFrankaEnv
    from dvla.envs.gym_adapter import GymVectorEnv
    from dvla.envs.libero_env import LiberoEnv
    from dvla.envs.options import Option

    listed = {name for name, _, _ in env_option_rows()}
    for env, cls in (("fast_reach", FastReachEnv), ("genesis_*", GenesisFrankaEnv), ("gym", GymVectorEnv),
                     ("libero", LiberoEnv)):
        for key, option in cls.OPTIONS.items():
            assert isinstance(option, Option) and option.doc, (env, key)
            assert f"env.options.{key} ({env})" in listed, (env, key)
    text = full_reference()
    assert "| `env.options.radius (fast_reach)` | 0.15 | a finite number in (0, 2]: " in text, text[-3000:]


def test_every_field_of_every_section_is_listed_with_its_default():
    cfg = JobConfig()
    listed = {name: default for name, default, _ in rows()}
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            assert f"{section.name}.{f.name}" in listed
    assert listed["swimlane.mode"] == "`async`" and listed["data_plane.send_hwm"] == "1"
    assert listed["data_plane.max_message_bytes"] == "2^30" and listed["swimlane.topology"] == "`''`"


def test_an_undocumented_field_is_an_error(tmp_path):
    @dataclasses.dataclass(kw_only=True)
    class Section:
        documented: int = 1
        """Has a line."""
        bare: int = 2

    assert field_docs(Section) == {"documented": "Has a line."}

    @dataclasses.dataclass(kw_only=True)
    class Job:
        section: Section = dataclasses.field(default_factory=Section)

    with pytest.raises(ValueError, match="section.bare: no documentation string"):
        rows(Job())


def test_write_replaces_only_the_marked_block(tmp_path, capsys):
    doc = tmp_path / "README.md"
    doc.write_text(f"intro\n{BEGIN}\nOLD TABLE\n{END}\noutro\n")
    assert cli(["config-ref", "--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("\noutro\n") and "OLD TABLE" not in text
    assert full_reference() in text and not write(doc, env_option_rows())  # second write: already current
    assert "updated" in capsys.readouterr().out


def test_write_without_a_path_writes_the_docs_page(monkeypatch, tmp_path, capsys):
    page = tmp_path / "configuration.md"
    page.write_text(f"{BEGIN}\nOLD\n{END}\n")
    monkeypatch.setattr("dvla.config.reference.DOC_PAGE", page)
    assert cli(["config-ref", "--write"]) == 0
    assert full_reference() in page.read_text() and "updated" in capsys.readouterr().out


def test_readme_is_a_short_front_page_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 220, "README.md is the front page: move details into docs/"
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    install = ('python3 -m venv .venv && . .venv/bin/activate && pip install "torch==2.13.0" '
               '-e ".[dev,vla]" && python -m dvla.launch')
    assert any(install in b.splitlines() for b in blocks), "the install-and-run command, alone on its line"
    assert any("python -m pytest -q" in b.splitlines() for b in blocks), "the test command, alone on its line"


def test_every_docs_page_is_in_the_index_toctree():
    index = (DOCS / "index.md").read_text()
    toctree = re.search(r"```\{toctree\}\n(.*?)```", index, re.S)
    assert toctree, "docs/index.md has no toctree"
    entries = {line.strip() for line in toctree.group(1).splitlines()
               if line.strip() and not line.strip().startswith(":")}
    pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
    assert pages <= entries, f"pages outside the toctree: {sorted(pages - entries)}"


def test_docs_build_strictly(tmp_path):
    """The site builds with every warning an error: broken links, missing references and pages
    outside the toctree fail it."""
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    out = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
                          str(DOCS), str(tmp_path / "html")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"sphinx build failed:\n{out.stdout}\n{out.stderr}"
