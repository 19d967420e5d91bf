"""The EGL device a simulator renders on is the rank's GPU, found by PCI address (or the CUDA
ordinal NVIDIA's EGL reports), not the CUDA ordinal taken as an EGL index: EGL's device order
need not be CUDA's and EGL ignores CUDA_VISIBLE_DEVICES. Made-up device lists for the
matching, this machine's EGL (Mesa llvmpipe, no GPU) for the enumeration, and LIBERO's host
with stand-ins for LIBERO for the wiring."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from dvla.envs import egl_devices
from dvla.envs.egl_devices import EglDevice, choose_render_device, match_egl_device, normalise_pci, pci_of_drm_node

A, B, C, D = "0000:1a:00", "0000:3b:00", "0000:88:00", "0000:b1:00"


def test_pci_addresses_compare_however_they_are_written():
    assert normalise_pci("0000:3B:00.0") == normalise_pci("00000000:3b:00.0") == normalise_pci("3b:00.0") == B
    assert normalise_pci(None) is None and normalise_pci("card1") is None and normalise_pci("zz:00.0") is None


def test_the_pci_address_decides_when_egl_order_is_not_cuda_order():
    # EGL lists the GPUs in reverse (and its CUDA ordinals say so, in the machine's numbering).
    devices = [(0, D, 3), (1, C, 2), (2, B, 1), (3, A, 0)]
    assert match_egl_device(devices, "0000:1A:00.0") == 3  # the rank's GPU is CUDA's first
    assert match_egl_device(devices, B + ".0", cuda_ordinal=0) == 2  # the PCI address wins over the ordinal
    # A software device (llvmpipe) first, GPUs without CUDA ordinals (no EGL_NV_device_cuda).
    assert match_egl_device([(0, None, None), (1, A, None), (2, B, None)], B) == 2
    # One GPU listed by two vendors' EGL: NVIDIA's entry (it reports a CUDA ordinal) first.
    assert match_egl_device([(0, A, None), (1, A, 0), (2, B, None)], A) == 1


def test_the_cuda_ordinal_decides_only_where_it_is_unambiguous():
    # No DRM device known (no /dev/dri in the container): the one GPU this rank sees is
    # CUDA ordinal 0, and only it reports an ordinal.
    assert match_egl_device([(0, None, None), (1, None, None), (2, None, 0)], B, cuda_ordinal=0,
                            cuda_devices=1) == 2
    # EGL reports more CUDA devices than the rank sees: it counts every GPU of the machine,
    # and its 0 is not this rank's.
    assert match_egl_device([(0, None, 1), (1, None, 0)], B, cuda_ordinal=0, cuda_devices=1) is None
    # An old driver reporting one ordinal for several devices.
    assert match_egl_device([(0, None, 0), (1, None, 0)], None, cuda_ordinal=0) is None
    # A device whose PCI address is known and is another GPU is not ours, whatever its ordinal.
    assert match_egl_device([(0, C, 0)], B, cuda_ordinal=0, cuda_devices=1) is None
    assert match_egl_device([], B, cuda_ordinal=0) is None and match_egl_device([(0, A, 0)], None) is None


def test_a_drm_device_file_leads_to_its_pci_address(tmp_path):
    pci_dir = tmp_path / "devices" / "pci0000:3a" / "0000:3b:00.0"
    pci_dir.mkdir(parents=True)
    (tmp_path / "drm" / "card1").mkdir(parents=True)
    (tmp_path / "drm" / "card1" / "device").symlink_to(pci_dir)
    drm = str(tmp_path / "drm")
    assert pci_of_drm_node(b"/dev/dri/card1", drm) == B  # the /dev file itself need not exist
    assert pci_of_drm_node("/dev/dri/card7", drm) is None and pci_of_drm_node(None, drm) is None


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(egl_devices, "_warned", set())
    monkeypatch.setattr(egl_devices, "_set_by_us", [])


def test_choosing_sets_mujoco_egl_device_id_or_warns_naming_what_it_found(fresh, caplog):
    gpus = [EglDevice(0, None, None, "EGL_MESA_device_software"), EglDevice(1, D, None), EglDevice(2, B, None)]
    env: dict[str, str] = {"CUDA_VISIBLE_DEVICES": "5"}
    assert choose_render_device(B + ".0", 0, 1, env, lambda: gpus) == 2
    assert env["MUJOCO_EGL_DEVICE_ID"] == "2"
    assert choose_render_device(B + ".0", 0, 1, env, lambda: gpus) == 2  # again: ours, not the user's
    env = {}
    caplog.clear()  # (the info lines above reach caplog where an earlier test set dvla's logger to INFO)
    with caplog.at_level(logging.WARNING, "dvla.envs.egl"):
        for _ in range(2):
            assert choose_render_device(A + ".0", 0, 1, env, lambda: gpus) == 0  # the old behaviour
    assert env == {}
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "no EGL device matches the rank's GPU (PCI 0000:1a:00.0" in warned[0]
    assert "EGL 0: software, PCI ?, CUDA ?; EGL 1: device, PCI 0000:b1:00" in warned[0]
    caplog.clear()
    env = {"MUJOCO_EGL_DEVICE_ID": "1"}  # the user's choice stands, with a warning
    with caplog.at_level(logging.WARNING, "dvla.envs.egl"):
        assert choose_render_device(B, 0, 1, env, lambda: gpus) == 1
    assert env == {"MUJOCO_EGL_DEVICE_ID": "1"} and "is EGL device 2" in caplog.records[0].getMessage()


def test_this_machines_egl_enumerates_and_matches_no_gpu():
    """Mesa (llvmpipe) here, no GPU: the enumeration runs, in a process of its own (PyOpenGL
    reads PYOPENGL_PLATFORM once), and no device matches a GPU's PCI address."""
    pytest.importorskip("mujoco")
    pytest.importorskip("OpenGL")
    code = ("import json; from dvla.envs.egl_devices import egl_devices, match_egl_device\n"
            "found = egl_devices()\n"
            "print(json.dumps({'devices': [[d.index, d.pci, d.cuda, d.extensions] for d in found],\n"
            "                  'match': match_egl_device([(d.index, d.pci, d.cuda) for d in found], '0000:3b:00.0',"
            " 0, 1)}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYOPENGL_PLATFORM": "egl", "MUJOCO_GL": "egl"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if not got["devices"]:
        pytest.skip("this machine's EGL lists no device")
    assert got["match"] is None, got
    assert all(pci is None and cuda is None for _, pci, cuda, _ in got["devices"]), got


class _Suite:
    def get_num_tasks(self):
        return 1

    def get_task(self, i):
        return types.SimpleNamespace(language="pick", problem_folder="f", bddl_file="t.bddl")

    def get_task_init_states(self, i):
        return np.zeros((2, 3))


class _Inner:
    """robosuite's env inside LIBERO's wrapper: its camera observables (sensors the host wraps)."""

    def __init__(self, camera_names=()):
        sensor = lambda cache: np.zeros((2, 2, 3), np.uint8)  # noqa: E731
        sensor.__modality__ = "image"
        self._observables = {f"{n}_image": types.SimpleNamespace(_sensor=sensor) for n in camera_names}

    def modify_observable(self, name, attribute, modifier):
        setattr(self._observables[name], f"_{attribute}", modifier)


class _Env:
    made: list[dict] = []

    def __init__(self, **kw):
        _Env.made.append(kw)
        self.env = _Inner(kw.get("camera_names", ()))

    def seed(self, s):
        pass

    def reset(self):
        return {}


def test_libero_renders_on_the_egl_device_of_the_ranks_gpu(monkeypatch, fresh):
    """A LIBERO host on CUDA ordinal 0 (the rank's one visible GPU) whose PCI address is EGL
    device 2's: robosuite gets render_gpu_device_id=2 (was 0) and MUJOCO_EGL_DEVICE_ID=2,
    set after LIBERO's import."""
    from dvla.envs import libero_env, libero_host

    bench = types.SimpleNamespace(get_benchmark=lambda name: (lambda task_order_index: _Suite()))
    monkeypatch.setattr(libero_host, "_import_libero", lambda: (bench, lambda key: "/b", _Env, _Env))
    monkeypatch.setattr(egl_devices, "egl_devices",
                        lambda sysfs=egl_devices.SYSFS_DRM: [EglDevice(0, D, None), EglDevice(1, None, None),
                                                             EglDevice(2, B, None)])
    monkeypatch.setenv("MUJOCO_EGL_DEVICE_ID", "unset")  # (restored on leaving)
    monkeypatch.delenv("MUJOCO_EGL_DEVICE_ID")
    fake = types.SimpleNamespace(pci_bus_id=lambda i: B + ".0", device_count=lambda: 1)
    monkeypatch.setattr(libero_env.runtime, "current", lambda: fake)
    target = libero_env.render_target(torch.device("cuda", 0))
    assert target == {"render_gpu": 0, "render_pci": B + ".0", "render_gpus": 1}
    assert libero_env.render_target(torch.device("cpu")) == {"render_gpu": -1}
    _Env.made.clear()
    libero_host.LiberoHost("libero_spatial", [0], 32, 0, True, 0, 0, **target)
    assert _Env.made[0]["render_gpu_device_id"] == 2
    assert os.environ.pop("MUJOCO_EGL_DEVICE_ID") == "2"
    _Env.made.clear()
    libero_host.LiberoHost("libero_spatial", [0], 32, 0, True, 0, 0, render_gpu=-1)  # the CPU: as before
    assert _Env.made[0]["render_gpu_device_id"] == -1 and "MUJOCO_EGL_DEVICE_ID" not in os.environ
