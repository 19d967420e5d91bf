"""Shared fixtures, and how the suite runs in parallel.

``python -m pytest -q`` (the README's command, and ``-m "not slow"``) runs the tests on three
pytest-xdist workers (``-n auto --dist loadgroup`` in pyproject.toml; ``-n 0`` runs them in
this process). ``-n auto`` means three workers where the run takes the whole suite on a machine
of two cores or more, none where files or tests are named on the command line (a single test
under a debugger, bench/gpu_kit.sh's CUDA tests) or there is one core. Three on two cores:
many tests wait more than they compute (the soak's learner, stragglers made slow by sleeping,
rank failures detected by timeouts), and a third worker computes meanwhile (9 min 11 s for the
suite with three, 11 min 15 s with two, on 2 cores; CPU time alike).

On the workers: tests that share an expensive set-up (a genesis or LIBERO scene, a set of
spawned ranks) carry ``xdist_group`` marks, so one worker builds it once; a test marked
``alone`` runs while no other test runs (the others wait between their tests): wall-clock
bounds of milliseconds and async learning runs whose thresholds were measured on an otherwise
idle machine.
"""

import fcntl
import logging
import os
import resource
import tempfile

# Headless rendering for genesis-world cameras; must be set before OpenGL loads.
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
# One intra-op thread per process, and OpenMP threads that wait for work sleep instead of
# spinning. The tests' models are tiny: a second thread barely shortens an op but doubles the
# CPU a test takes (a learning test: 11 s of CPU with two threads, 5 s with one). With more
# threads than cores (two workers, or a process's lanes each with a team of threads) spinning
# threads take the cores the others need: one learning test took 10x the CPU (291 s instead of
# 27 s) beside another. Set before torch loads OpenMP; subprocesses inherit both (torchrun
# gives its workers one thread anyway). A test that wants more threads sets them itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from dvla.config import presets  # noqa: E402
from planes.serial import DTYPES  # noqa: E402


@pytest.fixture(autouse=True)
def _dvla_logger():
    """A test that starts the launcher gets dvla's own console handler on the ``dvla`` logger
    (not propagated, dvla.logs); the next test starts from a logger that propagates to the
    root again, where ``caplog`` listens."""
    log = logging.getLogger("dvla")
    handlers, propagate, level = list(log.handlers), log.propagate, log.level
    yield
    log.handlers[:] = handlers
    log.propagate, log.level = propagate, level


@pytest.fixture(autouse=True)
def _device_runtime():
    """Every test leaves the process's device runtime (memory/runtime.py) as it found it: a
    CUDA runtime or a fake left installed would change what the next test runs on."""
    from memory import runtime

    before = runtime.current()
    yield
    left = runtime.current()
    if left is not before:
        runtime.install(before)
        pytest.fail(f"the test left {type(left).__name__} installed as the process's device runtime")


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
    from the default again (one, above; reductions, hence pinned numbers, depend on it)."""
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


@pytest.fixture(scope="session")
def launcher():
    """``launcher.run(module, args, cwd=...)``: ``python -m module args`` forked from a process
    that imported torch and dvla once (:mod:`tests.helpers.forks`), for tests of what a command
    prints and leaves, not of what it imports."""
    from tests.helpers.forks import Launcher

    forks = Launcher()
    yield forks
    forks.close()


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair (``tests/helpers/netns.py``), removed after the
    test; a skip where they cannot be made (a failure under ``DVLA_REQUIRE_NETNS=1``)."""
    from tests.helpers.netns import require_two_hosts

    yield from require_two_hosts()


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: see the module's docstring."""
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    return 3 if whole_suite and len(os.sched_getaffinity(0)) >= 2 else 0


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """On an xdist worker: the order below, and with ``--dist loadgroup`` the group suffix
    xdist puts on the node ids of ``xdist_group`` tests (``tests/x.py::test@group``, what its
    scheduler groups by). pytest 9.2 keeps node ids in ``_id``; xdist 3.8 still writes
    ``_nodeid``, so its grouping silently does nothing (pytest-dev/pytest-xdist#1386).
    Nothing to do where xdist's own suffix took."""
    if getattr(config, "workerinput", None) is None:
        return
    # Modules with tests of the slow tier first, each module's tests together and in their order
    # (a stable sort, the same on every worker, as xdist needs; module fixtures set up once):
    # the long tests start at once on both workers and the short ones fill in at the end,
    # instead of a long test starting last while the other worker has nothing left.
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow)
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodes import coerce_node_id

    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        nodeid = item.nodeid
        if names and "@" not in nodeid.rsplit("]", 1)[-1] and hasattr(item, "_id"):
            item._id = coerce_node_id(f"{nodeid}@{'_'.join(names)}")


def _run_lock(config):
    """A file every worker of this run locks around each test (None outside xdist)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    lock = getattr(config, "_dvla_run_lock", None)
    if lock is None:
        path = os.path.join(tempfile.gettempdir(), f"dvla-pytest-{workerinput['testrunuid']}.lock")
        lock = config._dvla_run_lock = open(path, "a")
    return lock


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, a test marked ``alone`` holds the run's lock exclusively, every other test
    shares it. The wait is outside the test's own phases (not in its duration)."""
    lock = _run_lock(item.config)
    if lock is not None:
        fcntl.flock(lock, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
    cpu0 = _cpu_seconds()
    try:
        yield
    finally:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_UN)
        if CPU_LOG:
            with open(CPU_LOG, "a") as f:
                f.write(f"{_cpu_seconds() - cpu0:.2f} {item.nodeid}\n")


CPU_LOG = os.environ.get("DVLA_TEST_CPU_LOG")
"""A file to which each test appends the CPU seconds it took (its process and the children it
waited for; spawned ranks kept for several tests count where they exit): on a loaded machine a
steadier measure than ``--durations``. ``sort -rn FILE | head`` lists the costliest."""


def _cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def pytest_unconfigure(config):
    lock = getattr(config, "_dvla_run_lock", None)
    if lock is not None:  # a worker that is done: the other holds its own descriptor
        lock.close()
        try:
            os.unlink(lock.name)
        except OSError:
            pass
