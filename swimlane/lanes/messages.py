"""The small messages between the sampling and inference lanes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from dvla.types import Observation


@dataclass
class Request:
    """An env group asks for actions (``act``) or for bootstrap values (``value``)."""

    group: int
    kind: str  # "act" | "value"
    obs: Observation


class Reply(NamedTuple):
    """The inference lane's answer: the group's share of one batched forward pass, and the
    weights version that produced it."""

    group: int
    kind: str
    out: Any  # ActOutput for "act", a (B,) value tensor for "value"
    version: int
