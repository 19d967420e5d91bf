"""What tests share: spawned ranks and torchrun jobs (:mod:`tests.helpers.ranks`), the recording
fake device runtime (:mod:`tests.helpers.fake_runtime`) and network namespaces standing in for
hosts (:mod:`tests.helpers.netns`)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root (the directory that holds ``dvla/`` and ``tests/``)."""
