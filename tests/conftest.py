import os

# Headless rendering for genesis-world cameras; must be set before OpenGL loads.
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

import pytest  # noqa: E402
import torch  # noqa: E402

from dvla import presets  # noqa: E402
from planes.serial import DTYPES  # noqa: E402


@pytest.fixture
def debug_cfg(tmp_path):
    cfg = presets.debug()
    cfg.run.out_dir = str(tmp_path / "run")
    return cfg


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _threads():
    """A run with ``run.torch_threads`` sets the process's thread count; the next test starts
    from the default again (reductions, hence pinned numbers, depend on it)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def every_dtype_tensors() -> dict[str, torch.Tensor]:
    """One tensor of each dtype the data plane carries, plus an empty, a 0-d and a
    non-contiguous one."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dt in DTYPES.items():
        if dt == torch.bool:
            out[name] = torch.rand(3, 5, generator=g) > 0.5
        elif dt.is_floating_point:
            out[name] = torch.randn(2, 3, 4, generator=g).to(dt)
        else:
            out[name] = torch.randint(-100 if dt != torch.uint8 else 0, 100, (7,), generator=g).to(dt)
    out["empty"] = torch.zeros(0, 4)
    out["scalar"] = torch.tensor(3.5)
    out["strided"] = torch.arange(12.0).view(3, 4).t()  # non-contiguous
    return out


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair (``tests/netns.py``), removed after the
    test; a skip where they cannot be made (a failure under ``DVLA_REQUIRE_NETNS=1``)."""
    from netns import require_two_hosts

    yield from require_two_hosts()
