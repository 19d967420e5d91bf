"""Import genesis-world without its slowest step.

quadrants (genesis' kernel compiler) asks, for each of the ~1,300 kernels genesis defines
at import, whether the decorator sits in a class body: it reads the frame's source line
through ``inspect.getframeinfo``, and that resolves the frame's module by scanning every
entry of ``sys.modules`` with ``hasattr`` calls, once per kernel. On two cores that scan
is about 10 of the 12 seconds ``import genesis`` takes, paid by every process that
simulates. :func:`import_genesis` swaps in a check that reads the same line straight from
``linecache`` (what ``getframeinfo`` ends up reading for a source file) before genesis
defines its kernels; the answer per frame is the same
(``tests/unit/dvla/test_genesis_import.py`` compares the two).
"""

from __future__ import annotations

import itertools
import linecache
import sys
from types import ModuleType


def inside_class(level_of_class_stackframe: int) -> bool:
    """quadrants' ``_inside_class``: whether the frame ``level_of_class_stackframe`` above
    the caller is a class body (its current line opens with ``class `` or
    ``@...data_oriented``), from ``linecache`` instead of ``inspect``."""
    from quadrants.lang import kernel_impl

    try:
        frame = sys._getframe(level_of_class_stackframe)
    except ValueError:
        return False
    # The line getframeinfo reports: where the frame's current instruction starts.
    lineno = frame.f_lineno
    if frame.f_lasti >= 0:
        start = next(itertools.islice(frame.f_code.co_positions(), frame.f_lasti // 2, None), (None,))[0]
        lineno = start if start is not None else lineno
    line = linecache.getline(frame.f_code.co_filename, lineno, frame.f_globals).strip()
    return any(pat.match(line) for pat in kernel_impl._KERNEL_CLASS_STACKFRAME_STMT_RES)


def import_genesis() -> ModuleType:
    """``import genesis``, with quadrants' class-body check replaced first (once)."""
    if sys.modules.get("genesis") is None:
        try:
            from quadrants.lang import kernel_impl
        except ImportError:
            pass  # genesis' own import says what is missing
        else:
            if callable(getattr(kernel_impl, "_inside_class", None)) and hasattr(
                    kernel_impl, "_KERNEL_CLASS_STACKFRAME_STMT_RES"):
                kernel_impl._inside_class = inside_class
    import genesis

    return genesis
