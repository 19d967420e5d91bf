"""The README's configuration reference is generated from the config dataclasses and must
match them; every config field carries its own documentation."""

import dataclasses
from pathlib import Path

import pytest

from dvla.cli import main as cli
from dvla.config import JobConfig
from dvla.config_doc import BEGIN, END, field_docs, reference, rows, write

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_reference_is_current():
    text = README.read_text()
    assert reference() in text, "README.md is out of date: run `dvla config-ref --write README.md`"


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
    assert reference() in text and not write(doc)  # second write: already current
    assert "updated" in capsys.readouterr().out
