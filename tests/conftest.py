import os

# Headless rendering for genesis-world cameras; must be set before OpenGL loads.
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

import pytest  # noqa: E402
import torch  # noqa: E402

from dvla import presets  # noqa: E402


@pytest.fixture
def debug_cfg(tmp_path):
    cfg = presets.debug()
    cfg.run.out_dir = str(tmp_path / "run")
    return cfg


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
