"""Which EGL device renders on the rank's GPU.

MuJoCo simulators (robosuite, LIBERO) render headless through EGL and pick their EGL device
by *index* into EGL's own device list (``eglQueryDevicesEXT``): robosuite's
``render_gpu_device_id``, or the environment variable ``MUJOCO_EGL_DEVICE_ID``, or, when that
is unset, the value of ``CUDA_VISIBLE_DEVICES`` read as an EGL index. EGL's order need not be
CUDA's (it may be reversed, and a software device may come first), and EGL ignores
``CUDA_VISIBLE_DEVICES``: a rank that sees only its own GPU, as ``cuda:0``, must not pass 0
(nor its physical ordinal) as the EGL index.

The EGL device is found by matching instead: each EGL device's PCI address (its DRM device
file, ``EGL_EXT_device_drm``, ``/dev/dri/cardN`` -> ``/sys/class/drm/cardN/device`` -> the PCI
address) against the rank's CUDA device's (torch's ``pci_domain_id:pci_bus_id:pci_device_id``),
and where no PCI address is known, the CUDA ordinal NVIDIA's EGL reports
(``EGL_NV_device_cuda``, in the numbering of the CUDA devices this process sees). The matching
is :func:`match_egl_device` (pure); :func:`egl_devices` enumerates; :func:`choose_render_device`
is what a simulator host calls.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Callable, MutableMapping, Sequence

log = logging.getLogger("dvla.envs.egl")

EGL_EXTENSIONS = 0x3055
EGL_DRM_DEVICE_FILE_EXT = 0x3233  # EGL_EXT_device_drm
EGL_DRM_RENDER_NODE_FILE_EXT = 0x3377  # EGL_EXT_device_drm_render_node
EGL_CUDA_DEVICE_NV = 0x323A  # EGL_NV_device_cuda
SYSFS_DRM = "/sys/class/drm"

_warned: set[str] = set()  # one warning per message and process
_set_by_us: list[str] = []  # the MUJOCO_EGL_DEVICE_ID values this process set


@dataclass(frozen=True)
class EglDevice:
    """One EGL device: its index in EGL's list (robosuite's ``render_gpu_device_id``), its PCI
    address (``0000:3b:00``, None where EGL names no DRM device) and its CUDA ordinal (None
    without ``EGL_NV_device_cuda``)."""

    index: int
    pci: str | None
    cuda: int | None
    extensions: str = ""

    def describe(self) -> str:
        kind = "software" if "EGL_MESA_device_software" in self.extensions.split() else "device"
        return f"EGL {self.index}: {kind}, PCI {self.pci or '?'}, CUDA {'?' if self.cuda is None else self.cuda}"


def normalise_pci(address: str | None) -> str | None:
    """``domain:bus:device`` in lower-case hex (``0000:3b:00``) of a PCI address written as
    sysfs (``0000:3b:00.0``), nvidia-smi (``00000000:3B:00.0``) or without a domain
    (``3b:00.0``) writes it; None for None or what does not parse."""
    if not address:
        return None
    parts = address.strip().lower().split(":")
    if len(parts) not in (2, 3):
        return None
    domain = parts[0] if len(parts) == 3 else "0"
    try:
        return f"{int(domain, 16):04x}:{int(parts[-2], 16):02x}:{int(parts[-1].split('.')[0], 16):02x}"
    except ValueError:
        return None


def pci_of_drm_node(path: str | bytes | None, sysfs: str = SYSFS_DRM) -> str | None:
    """The PCI address of a DRM device file (``/dev/dri/card1``, ``/dev/dri/renderD128``): the
    device its sysfs entry links to (the file itself need not exist in this container)."""
    if not path:
        return None
    name = os.path.basename(os.fsdecode(path))
    target = os.path.realpath(os.path.join(sysfs, name, "device"))
    if not os.path.exists(target):
        return None
    return normalise_pci(os.path.basename(target))


def match_egl_device(devices: Sequence[tuple[int, str | None, int | None]], pci: str | None,
                     cuda_ordinal: int | None = None, cuda_devices: int | None = None) -> int | None:
    """The EGL index of the rank's GPU among ``devices`` (``(egl index, PCI address or None,
    CUDA ordinal or None)``, as :func:`egl_devices` reports them), or None.

    The PCI address ``pci`` decides where an EGL device has one (the first such device wins:
    a GPU listed twice, by two vendors' EGL, is the same GPU; one that also reports a CUDA
    ordinal, NVIDIA's, first). Else the one device whose CUDA ordinal is ``cuda_ordinal``
    (counted among the CUDA devices this process sees; a device whose PCI address is known
    and is not ``pci`` is not ours), trusted only when unique and when EGL reports no more
    CUDA devices than this process sees (``cuda_devices``): more would mean EGL counts
    every GPU of the machine, in which ordinal 0 is not this rank's."""
    want = normalise_pci(pci)
    if want is not None:
        same = [(i, c) for i, p, c in devices if normalise_pci(p) == want]
        if same:
            return sorted(same, key=lambda ic: ic[1] is None)[0][0]
    if cuda_ordinal is None:
        return None
    reporting = [(i, p, c) for i, p, c in devices if c is not None]
    if cuda_devices is not None and len(reporting) > cuda_devices:
        return None
    same = [i for i, p, c in reporting if c == cuda_ordinal and (want is None or normalise_pci(p) is None)]
    return same[0] if len(same) == 1 else None


def _proc(egl, name: str, restype, *argtypes):
    """An EGL extension function by name (eglGetProcAddress), or None where EGL lacks it."""
    try:
        addr = egl.eglGetProcAddress(name)
    except Exception:  # noqa: BLE001 - no such entry point in this EGL
        return None
    if not addr:  # (PyOpenGL returns the address as an int, None for an unknown name)
        return None
    return ctypes.CFUNCTYPE(restype, *argtypes)(addr)


def egl_devices(sysfs: str = SYSFS_DRM) -> list[EglDevice]:
    """EGL's devices in the order robosuite and MuJoCo index them (``mujoco.egl``'s
    ``eglQueryDevicesEXT``), each with its PCI address and CUDA ordinal where EGL tells them.
    Needs ``PYOPENGL_PLATFORM=egl`` before PyOpenGL is first imported in the process; an
    empty list where EGL cannot enumerate devices."""
    try:
        from mujoco.egl import egl_ext as EGL
    except (ImportError, AttributeError) as exc:  # no EGL, or no device enumeration
        log.debug("EGL devices: cannot enumerate (%s)", exc)
        return []
    devices = EGL.eglQueryDevicesEXT()
    query_string = _proc(EGL, "eglQueryDeviceStringEXT", ctypes.c_char_p, EGL.EGLDeviceEXT, EGL.EGLint)
    query_attrib = _proc(EGL, "eglQueryDeviceAttribEXT", EGL.EGLBoolean, EGL.EGLDeviceEXT, EGL.EGLint,
                         ctypes.POINTER(ctypes.c_ssize_t))

    def string(dev, name: int) -> bytes | None:
        return query_string(dev, name) if query_string is not None else None

    out = []
    for i, dev in enumerate(devices):
        extensions = (string(dev, EGL_EXTENSIONS) or b"").decode(errors="replace")
        names = extensions.split()
        pci = None
        for ext, attr in (("EGL_EXT_device_drm", EGL_DRM_DEVICE_FILE_EXT),
                          ("EGL_EXT_device_drm_render_node", EGL_DRM_RENDER_NODE_FILE_EXT)):
            if pci is None and ext in names:
                pci = pci_of_drm_node(string(dev, attr), sysfs)
        cuda = None
        if query_attrib is not None and "EGL_NV_device_cuda" in names:
            value = ctypes.c_ssize_t(-1)
            if query_attrib(dev, EGL_CUDA_DEVICE_NV, ctypes.byref(value)) and value.value >= 0:
                cuda = int(value.value)
        out.append(EglDevice(i, pci, cuda, extensions))
    EGL.eglGetError()  # a failed query leaves an error behind: clear it for the renderer's checks
    return out


def _warn_once(message: str, *args) -> None:
    text = message % args
    if text not in _warned:
        _warned.add(text)
        log.warning(text)


def choose_render_device(pci: str | None, cuda_ordinal: int, cuda_devices: int | None = None,
                         environ: MutableMapping[str, str] = os.environ,
                         enumerate_devices: Callable[[], list[EglDevice]] | None = None) -> int:
    """The EGL device a MuJoCo/robosuite renderer in this process should use for the rank's
    GPU (PCI address ``pci``, CUDA ordinal ``cuda_ordinal`` among ``cuda_devices`` visible),
    returned as robosuite's ``render_gpu_device_id`` and set as ``MUJOCO_EGL_DEVICE_ID``,
    which robosuite and MuJoCo read when they open their EGL display (robosuite reads it over
    ``CUDA_VISIBLE_DEVICES``). Set it after importing robosuite: its import asserts that the
    variable is one of ``CUDA_VISIBLE_DEVICES``'s values, mistaking EGL indices for CUDA ids.

    A ``MUJOCO_EGL_DEVICE_ID`` set by the user is kept (with a warning where it is not the
    GPU matched). Where no EGL device matches, the old behaviour: ``cuda_ordinal`` as the EGL
    index, the variable untouched, and one warning naming the devices found."""
    found = (enumerate_devices or egl_devices)()
    index = match_egl_device([(d.index, d.pci, d.cuda) for d in found], pci, cuda_ordinal, cuda_devices)
    seen = "; ".join(d.describe() for d in found) or "none"
    user = environ.get("MUJOCO_EGL_DEVICE_ID")
    if user is not None and user not in _set_by_us:
        if index is not None and user != str(index):
            _warn_once("MUJOCO_EGL_DEVICE_ID=%s is set: rendering on EGL device %s, though the rank's GPU (PCI %s) "
                       "is EGL device %d (found: %s)", user, user, pci, index, seen)
        return int(user) if user.isdigit() else cuda_ordinal
    if index is None:
        _warn_once("no EGL device matches the rank's GPU (PCI %s, CUDA ordinal %d); found: %s. Rendering with "
                   "render_gpu_device_id=%d as before, which robosuite takes as an EGL index (or "
                   "CUDA_VISIBLE_DEVICES's value): it may render on another GPU", pci, cuda_ordinal, seen,
                   cuda_ordinal)
        return cuda_ordinal
    environ["MUJOCO_EGL_DEVICE_ID"] = str(index)
    _set_by_us.append(str(index))
    log.info("rendering on EGL device %d, the rank's GPU (PCI %s)", index, pci)
    return index
