"""What both ends of the data plane share: message and counter types, timing constants,
host identity, endpoint lookup in the store, and process-wide receive-memory settings
(see :mod:`planes.data` for the design)."""

from __future__ import annotations

import collections
import ctypes
import datetime
import glob
import logging
import os
import platform
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
from torch import Tensor

log = logging.getLogger("dvla.planes.data")

HEARTBEAT_KIND = "_hb"
_DISCARD = bytearray()  # recv_into an empty buffer drops a frame
_RECV_WAIT_MS = 50  # the longest wait in one receive call, before periodic checks
_PREFETCH_AFTER_S = 0.002  # the background thread prefetches once the consumer is this long away
_SNDMORE = int(zmq.SNDMORE)  # a plain int: combining flag enums per frame costs more than the send


@dataclass
class Message:
    kind: str
    meta: dict[str, Any]
    tensors: dict[str, Tensor]
    sender: str
    seq: int


@dataclass
class Counters:
    sent: int = 0
    received: int = 0
    prefetched: int = 0  # of those received, how many the background thread took while the consumer was busy
    rejected: dict[str, int] = field(default_factory=lambda: collections.Counter())
    dropped: dict[str, int] = field(default_factory=lambda: collections.Counter())


class BackpressureTimeout(TimeoutError):
    """``send`` waited ``send_timeout_s`` for the receiver to take messages."""


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
_HEAP_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit
_HEAP_TRIM_THRESHOLD = 32 << 20
_heap_kept = False


def keep_freed_memory_for_reuse() -> bool:
    """Tell glibc's malloc to serve blocks below 32 MiB from its heaps and to keep up to
    32 MiB of freed memory at their tops, for this whole process. True if it took effect
    (now or before); False where the C library is not glibc.

    Why: libzmq allocates each received message with malloc, in its I/O thread. With
    glibc's defaults a multi-MB block is mapped afresh (or the heap top trimmed and grown
    again) as chunks come and go, and every page of it faults in when the frame is
    written: on loopback tcp, page faults were most of the receiving side's extra kernel
    time (bench/RESULTS.md). With these settings freed receive buffers are reused."""
    global _heap_kept
    if _heap_kept:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _heap_kept = (mallopt(_M_MMAP_THRESHOLD, _HEAP_MMAP_THRESHOLD) == 1
                  and mallopt(_M_TRIM_THRESHOLD, _HEAP_TRIM_THRESHOLD) == 1)
    return _heap_kept


def remove_stale_ipc_files(directory: str | None = None) -> list[str]:
    """Delete the ``ipc://`` socket directories (and older single socket files) that
    receivers of processes no longer alive left behind (a killed run cannot remove its
    own); returns the paths removed. A receiver's directory is named ``dvla-<pid>-<random>``
    (a file: ``dvla-<pid>-<random>.sock``); those of live processes and of other users are
    left alone."""
    directory = directory or tempfile.gettempdir()
    removed = []
    for path in glob.glob(os.path.join(directory, "dvla-*-*")):
        pid = os.path.basename(path).split("-")[1]
        is_dir = os.path.isdir(path) and not os.path.islink(path)
        if not pid.isdigit() or int(pid) == os.getpid() or not (is_dir or path.endswith(".sock")):
            continue
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:  # no such process: stale
            try:
                if is_dir:
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
                removed.append(path)
            except FileNotFoundError:  # another receiver removed it first
                pass
        except (PermissionError, FileNotFoundError):  # alive under another user, or already gone
            pass
    return removed


def _hostname() -> str:
    """This machine's name (``DVLA_FAKE_HOSTNAME`` overrides it, as in ``launch.topology.host_name``)."""
    return os.environ.get("DVLA_FAKE_HOSTNAME") or socket.gethostname()


def lookup_endpoints(store, key: str = "dvla/data/0", timeout_s: float = 60.0) -> dict[str, str]:
    """Read a receiver's published endpoints from the store (waits until present)."""
    store.wait([key], datetime.timedelta(seconds=timeout_s))
    return msgpack.unpackb(store.get(key), raw=False)
