"""dvla's console lines: ``[dvla] message`` on rank 0, ``[dvla rank N]`` elsewhere, on a handler
of dvla's own logger (a plugin that configures the root logger changes nothing in them)."""

from __future__ import annotations

import logging
import sys


class _Formatter(logging.Formatter):
    """``[dvla] message``; warnings and errors say so; other ranks name themselves; loggers
    outside dvla are named."""

    def __init__(self, rank: int):
        super().__init__()
        self.tag = "dvla" if rank == 0 else f"dvla rank {rank}"

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        name = "" if record.name == "dvla" or record.name.startswith("dvla.") else f"{record.name}: "
        text = f"[{self.tag}] {level}{name}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(rank: int = 0, verbose: bool = False) -> None:
    """dvla's loggers at INFO on rank 0 and WARNING on the others (DEBUG everywhere with
    ``verbose``), other libraries' at ERROR (WARNING with ``verbose``), one concise line
    each on stderr. dvla's lines go through a handler of the ``dvla`` logger that does not
    propagate: a plugin that configures the root logger (``logging.basicConfig``, as
    lerobot does) changes nothing in them, nor prints them a second time."""
    root, ours = logging.getLogger(), logging.getLogger("dvla")
    for lg in (root, ours):
        for h in list(lg.handlers):
            if getattr(h, "_dvla", False):
                lg.removeHandler(h)
    for lg in (root, ours):  # the root's: other libraries' lines
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Formatter(rank))
        handler._dvla = True  # type: ignore[attr-defined]
        lg.addHandler(handler)
    ours.propagate = False
    root.setLevel(logging.WARNING if verbose else logging.ERROR)
    ours.setLevel(logging.DEBUG if verbose else logging.INFO if rank == 0 else logging.WARNING)
    logging.captureWarnings(verbose)
