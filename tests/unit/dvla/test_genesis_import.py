"""dvla's class-body check for quadrants' kernels answers as quadrants' own does."""

import pytest

kernel_impl = pytest.importorskip("quadrants.lang.kernel_impl")

from dvla.envs.genesis_import import inside_class  # noqa: E402

ORIGINAL = kernel_impl.__dict__["_inside_class"]


def _both(level: int = 1) -> tuple[bool, bool]:
    """Both checks asked about the frame ``level`` above the caller, as quadrants asks: the
    decorator's frame calls the check with the class frame's distance from the check."""
    return ORIGINAL(level + 1), inside_class(level + 1)


def test_a_class_body_a_data_oriented_class_and_a_function_agree():
    # level 2: the frame that runs the class statement, as for a kernel in a class body
    class Plain:
        seen = _both(2)
        inside = _both(1)  # the class body itself: its line is this statement

    def data_oriented(cls):
        return cls

    @data_oriented
    class Oriented:
        seen = _both(2)

    def in_function():
        return _both()

    assert Plain.seen == (True, True)
    assert Plain.inside == (False, False)
    assert Oriented.seen == (True, True)
    assert in_function() == (False, False)
    assert _both(level=200) == (False, False)  # beyond the stack


def test_import_genesis_swaps_the_check_only_before_genesis_is_imported(monkeypatch):
    import sys

    from dvla.envs import genesis_import

    fake = type(sys)("genesis")
    monkeypatch.setitem(sys.modules, "genesis", fake)
    monkeypatch.setattr(kernel_impl, "_inside_class", ORIGINAL)
    assert genesis_import.import_genesis() is fake
    assert kernel_impl._inside_class is ORIGINAL  # genesis was there already: nothing to speed up
    monkeypatch.delitem(sys.modules, "genesis")
    monkeypatch.setitem(sys.modules, "genesis", None)  # the next import fails, after the swap
    with pytest.raises(ImportError):
        genesis_import.import_genesis()
    assert kernel_impl._inside_class is inside_class
