"""What the two training applications do around their work on every rank of a job, written
once: RL (``dvla train``, :mod:`dvla.app.train`) and the supervised warm start (``dvla sft``,
:mod:`dvla.app.sft`) behave the same here.

* **One GPU per rank** (:func:`see_own_gpu`): under torchrun, ``CUDA_VISIBLE_DEVICES`` narrowed
  to the rank's own GPU before anything starts CUDA.
* **One run directory** (:func:`share_run_dir`): rank 0 chooses it (:mod:`dvla.state.rundir`)
  and tells the other ranks through the job's store (c10d), so that every rank writes to the
  same one; rank 0's mistake reaches the others as a :class:`RelayedError`.
* **One line per error** (:func:`fail`): a mistake in the configuration or the data is one line
  and exit code 2, said once per host; anything else on a job of several ranks is one line
  naming the lost rank and what to run next (exit 1); a new run that failed leaves no
  directory behind. The rank that finds a mistake tells the job (:data:`USER_ERROR_KEY` in
  the store) before it leaves, so the ranks that then lose it exit 2 without a line of
  their own instead of reporting it lost.
* **Signals** (:class:`JobStop`) and **leaving** (:func:`leave`, :func:`abandon`): SIGTERM or
  SIGINT at any rank stops every rank, with a checkpoint, and they leave together; a job
  whose peers may be gone leaves without a teardown barrier.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, NoReturn

from dvla.config import ConfigError
from dvla.distributed import shutdown, uses_nccl
from dvla.state.rundir import discard_new_run, pick_run_dir

EXIT_USER_ERROR = 2
RUN_DIR_KEY = "dvla/run_dir"
USER_ERROR_KEY = "dvla/user_errors"  # ranks that found a mistake: the first of each host says it, the others stay quiet


class RelayedError(ConfigError):
    """Rank 0's error, as the other ranks learn it (rank 0 says it)."""


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def restarts() -> int:
    """How often torchrun restarted this worker group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def see_own_gpu() -> None:
    """Under torchrun, narrow ``CUDA_VISIBLE_DEVICES`` to this rank's GPU before CUDA starts
    in the process, so that torch, simulators and renderers agree on one device, ``cuda:0``
    (memory/runtime.py). A ConfigError when the list names too few GPUs."""
    if "LOCAL_RANK" not in os.environ or os.environ.get("DVLA_VISIBLE_DEVICE_SET"):
        return
    from memory.runtime import visible_device_env

    try:
        os.environ.update(visible_device_env(local_rank()))
    except ValueError as exc:
        raise ConfigError(f"CUDA_VISIBLE_DEVICES: {exc}") from None


# -- the run directory --------------------------------------------------------------------------


@dataclass
class RunDir:
    path: Path
    resumed: bool  # it continues a run
    previous: Path | None  # rank 0: the run ``latest`` pointed to before (None elsewhere)

    def discard_if_new(self, rank: int) -> None:
        """Rank 0, after a failure: a new run that wrote nothing is removed (``latest`` back)."""
        if rank == 0 and not self.resumed:
            discard_new_run(self.path.parent, self.path, self.previous)


def share_run_dir(base: str | os.PathLike, cfg, rank: int, world: int, restarts: int,
                  unit: str = "updates") -> RunDir:
    """Rank 0 chooses the run directory under ``base`` (:func:`dvla.state.rundir.pick_run_dir`)
    and tells the other ranks through the torch.distributed store; rank 0's error is a
    :class:`RelayedError` on the others."""
    if world == 1:
        return RunDir(*pick_run_dir(base, cfg, restarts, unit=unit))
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        try:
            run = RunDir(*pick_run_dir(base, cfg, restarts, unit=unit))
        except ConfigError as exc:
            store.set(RUN_DIR_KEY, json.dumps({"error": str(exc)}))
            raise
        store.set(RUN_DIR_KEY, json.dumps({"dir": str(run.path), "resumed": run.resumed}))
        return run
    data = json.loads(store.get(RUN_DIR_KEY))
    if "error" in data:
        raise RelayedError(data["error"])
    return RunDir(Path(data["dir"]), bool(data["resumed"]), None)


# -- errors -------------------------------------------------------------------------------------


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def say_error(prog: str, exc: BaseException, rank: int | None = None) -> None:
    where = "" if not rank else f" (rank {rank})"
    print(f"{prog}: error{where}: {one_line(exc)}", file=sys.stderr, flush=True)


def user_error(exc: BaseException, kinds: tuple[type[BaseException], ...] = (ConfigError,)) -> BaseException | None:
    """The user's mistake behind ``exc`` (itself, or what a lane raised), else None."""
    if isinstance(exc, kinds):
        return exc
    original = getattr(exc, "original", None)  # swimlane.LaneError
    return original if isinstance(original, kinds) else None


def lost_rank_line(prog: str, exc: BaseException, rank: int) -> str:
    """One line for a rank whose job lost a peer (or failed): which rank, if the error
    names one, the first line of the error, and what to run next."""
    original = getattr(exc, "original", exc)
    first = one_line((str(original).splitlines() or [""])[0]) or type(original).__name__
    named = re.search(r"\branks?(?:\(s\))?\s+((?:rank)?\d+(?:,\s*(?:rank)?\d+)*)", first)
    ranks = named.group(1).replace("rank", "") if named else ""
    lost = (f"rank {ranks} was lost" if "," not in ranks else f"ranks {ranks} were lost") if named \
        else "the job failed or lost a rank"
    return (f"{prog}: error (rank {rank}): {lost}: {first[:300]}. Next: run the same command with --resume to "
            "continue from the last checkpoint (--debug shows the traceback)")


def fail(prog: str, exc: BaseException, *, rank: int, world: int, run: RunDir | None,
         kinds: tuple[type[BaseException], ...] = (ConfigError,), debug: bool = False) -> int:
    """The end of a rank whose work raised ``exc``: a new run directory removed, one line, and
    the exit code (one process) or an exit without the teardown barrier (a job of several,
    where a peer may wait in a collective that can never complete: torchrun then stops the
    others). Re-raises what is no user error in one process, and with ``debug``."""
    if run is not None:
        run.discard_if_new(rank)
    err = user_error(exc, kinds)
    quiet = False
    if world > 1 and err is not None and not isinstance(err, RelayedError):
        quiet = not _tell_job()  # the same mistake found by several ranks is said once
    elif world > 1 and err is None and not isinstance(exc, KeyboardInterrupt) and not debug and _job_was_told():
        sys.stdout.flush()
        _left(rank)
        abandon(EXIT_USER_ERROR)  # a peer left over a mistake it has already said
    if isinstance(exc, KeyboardInterrupt):
        print(f"{prog}: interrupted{f'; partial results in {run.path}' if run is not None else ''}",
              file=sys.stderr, flush=True)
        code = 130
    elif err is not None and not debug:
        if not quiet and (not isinstance(err, RelayedError) or local_rank() == 0):  # once per host
            say_error(prog, err, rank if world > 1 and not isinstance(err, RelayedError) else None)
        code = EXIT_USER_ERROR
    elif world == 1:
        raise exc
    else:
        if debug:
            traceback.print_exception(exc)
        print(lost_rank_line(prog, exc, rank), file=sys.stderr, flush=True)
        code = 1
    if world == 1:
        return code
    sys.stdout.flush()
    _left(rank)
    abandon(code)


_job_store: list = []


def _store():
    """The job's store in a key space of dvla's own (one connection per process): torchrun's
    agent's, which outlives every rank (:func:`dvla.distributed.groups.store_client`);
    elsewhere the process group's."""
    if not _job_store:
        import torch.distributed as dist

        from dvla.distributed.groups import store_client

        _job_store.append(store_client() or dist.distributed_c10d._get_default_store())
    return _job_store[0]


def _tell_job() -> bool:
    """Count this rank's mistake in the store; True for the first rank of its host to find
    one (so each host's log says why its ranks stopped, once)."""
    from launch.topology import host_name

    try:
        store = _store()
        store.add(USER_ERROR_KEY, 1)
        return int(store.add(f"{USER_ERROR_KEY}/{host_name()}", 1)) == 1
    except Exception:  # no store (it left with its host): the others report a lost rank
        return True


def _left(rank: int) -> None:
    """Tell ranks that stopped (:meth:`JobStop.leave`) not to wait for this one."""
    try:
        _store().set(f"{LEFT_KEY}{rank}", "failed")
    except Exception:
        pass


def _job_was_told() -> bool:
    try:
        return bool(_store().check([USER_ERROR_KEY]))
    except Exception:
        return False


# -- signals and leaving ------------------------------------------------------------------------


STOP_KEY = "dvla/stop"  # set by the first rank a stop signal reaches: rank 0 then stops the job
STOP_SEEN_KEY = "dvla/stop_seen"  # set by rank 0 once it has the stop: the job will end as one
STOP_SEEN_WAIT_S = 5.0  # how long a signalled rank waits for rank 0 to see the stop before it leaves alone
LEFT_KEY = "dvla/left/"  # + rank: this rank stopped and is about to exit
LEAVE_WAIT_S = 20.0  # how long a stopped rank waits for the others before it exits anyway


class JobStop:
    """SIGTERM or SIGINT, at any rank or at all of them at once (torchrun stopping its group,
    Slurm or Kubernetes preempting a job, Ctrl-C), stops the whole job as one, the way it
    ends at its last update: a rank other than 0 that gets the signal says so in the job's
    store (:data:`STOP_KEY`) and goes on; rank 0, waiting on that key in a thread of its own
    (its own store connection, :func:`dvla.distributed.groups.store_client`), or getting the
    signal itself, stops (:meth:`swimlane.Swimlane.preempt`: its gradient lane checkpoints on
    its way out), and its end reaches every other rank as a run's end does (the broadcast's
    shutdown marker, the learners' ordering), so that no rank leaves a collective its peers
    are still in. The ranks then leave together (:meth:`leave`). A second SIGINT interrupts
    at once (KeyboardInterrupt)."""

    def __init__(self, rank: int = 0, world: int = 1):
        """Handles the signals from now on; :meth:`attach` names what stops the lanes once
        they exist (a signal before that stops them as soon as they do)."""
        self.stop_lanes: Callable[[], None] | None = None
        self.rank, self.world = rank, world
        self.by: str | None = None  # what stopped this rank ("SIGTERM at rank 1"), None while running
        self._lock = threading.Lock()
        self.store = None
        if world > 1:
            try:
                self.store = _store()
            except Exception:  # no process group (yet): a stop then reaches the others through the lanes
                pass
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        if world > 1 and rank == 0:
            threading.Thread(target=self._watch, name="dvla-job-stop", daemon=True).start()

    @property
    def stopped(self) -> bool:
        return self.by is not None

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self.by is not None and self.by.startswith("SIGINT"):
            raise KeyboardInterrupt  # the second Ctrl-C
        why = f"{signal.Signals(signum).name} at rank {self.rank}"
        if self.rank == 0:
            if self.world > 1 and self.by is None:
                self._tell(why)  # first, so that every rank knows its run's end is a stop's
                self._seen()
            self._stop(why)
        elif self.by is None:
            self.by = why  # rank 0 stops the job: its end reaches this rank as a run's end does
            threading.Thread(target=self._tell_or_leave, args=(why,), daemon=True).start()  # (a store call may block)

    def attach(self, stop: Callable[[], None]) -> None:
        with self._lock:
            self.stop_lanes = stop
            stopped = self.by is not None
        if stopped:
            stop()

    def _stop(self, why: str) -> None:
        with self._lock:
            if self.by is not None:
                return
            self.by = why
            stop = self.stop_lanes
        if stop is not None:
            stop()

    def _tell(self, why: str) -> None:
        try:
            self.store.set(STOP_KEY, why)
        except Exception:  # no store: the others stop when the lanes lose this rank
            pass

    def _tell_or_leave(self, why: str) -> None:
        """A rank other than 0: say so, then wait (:data:`STOP_SEEN_WAIT_S`) for rank 0 to see
        it; where rank 0 is gone (failed or killed: torchrun signals the survivors of a rank
        it lost), no one is left to end the job, so this rank leaves at once instead of
        sitting out torchrun's grace period until it is killed: exit 2 where a rank's mistake
        ended the job (as :meth:`leave`), else 1."""
        from dvla.distributed.groups import store_client

        self._tell(why)
        try:
            # A peer's mistake ends the job (it has said so), or rank 0 failed (fail() marks it):
            # leave without waiting. Otherwise wait for rank 0 on a connection of its own.
            gone = _job_was_told() or (self.store.check([f"{LEFT_KEY}0"])
                                        and self.store.get(f"{LEFT_KEY}0") == b"failed")
            if not gone:
                client = store_client(timeout_s=STOP_SEEN_WAIT_S)
                if client is None:
                    return  # (no store outlives the ranks here: the lanes lose rank 0 instead)
                client.wait([STOP_SEEN_KEY], timedelta(seconds=STOP_SEEN_WAIT_S))
                return  # rank 0 ends the job as one
        except Exception:  # not seen in time, or the store is going: rank 0 is gone
            pass
        sys.stdout.flush()
        abandon(EXIT_USER_ERROR if _job_was_told() else 1)  # (a peer's mistake, said by it, ended the job)

    def _seen(self) -> None:
        """Rank 0 has the stop: the signalled ranks wait for the job's end."""
        try:
            self.store.set(STOP_SEEN_KEY, "1")
        except Exception:
            pass

    def _watch(self) -> None:
        from dvla.distributed.groups import store_client

        try:
            client = store_client()  # a connection of its own: a wait holds one
            if client is None:
                return  # (no store outlives the ranks here: a stop reaches the others through the lanes)
            while self.by is None:
                try:
                    client.wait([STOP_KEY], timedelta(seconds=600))
                    break
                except _store_timeout():
                    continue
            why = client.get(STOP_KEY).decode()
            client.set(STOP_SEEN_KEY, "1")
        except Exception:  # the store went away (the job is ending): nothing to watch
            return
        self._stop(why)

    def job_stopped(self) -> bool:
        """Whether a rank of the job said it was stopped."""
        try:
            return self.world > 1 and bool(self.store.check([STOP_KEY]))
        except Exception:
            return False

    def leave(self) -> NoReturn:
        """A stopped rank's exit: once every rank of the job has stopped or failed (or after
        :data:`LEAVE_WAIT_S`, when a peer was killed), exit 0 without a teardown barrier."""
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            store = self.store
            if not store.check([STOP_KEY]):  # (a peer's stop ended this rank's run: it has said so)
                store.set(STOP_KEY, self.by or "a stop")
            store.set(f"{LEFT_KEY}{self.rank}", "1")
            store.wait([f"{LEFT_KEY}{r}" for r in range(self.world)], timedelta(seconds=LEAVE_WAIT_S))
        except Exception:  # a peer is gone, or the store with it: leave anyway
            pass
        abandon(EXIT_USER_ERROR if _job_was_told() else 0)  # (the stop came as a peer left over a mistake)


def _store_timeout() -> type[BaseException]:
    import torch.distributed as dist

    return getattr(dist, "DistStoreError", RuntimeError)


def abandon(code: int) -> NoReturn:
    """Leave a job whose peers may be gone: NCCL's communicators aborted (no barrier, no
    destroy that would wait for a dead peer), then exit at once."""
    try:
        shutdown(barrier=False) if uses_nccl() else None
    finally:
        os._exit(code)


def leave(world: int, stop: JobStop | None = None) -> int:
    """The end of a rank that finished: in a job of several, the teardown (a barrier; after a
    stop signal :meth:`JobStop.leave` instead) and an exit without the interpreter's own
    teardown (a torch thread still joinable at exit has aborted a rank, SIGABRT, after
    everything was written and the group destroyed)."""
    if world == 1:
        shutdown()
        return 0
    if stop is not None and (stop.stopped or stop.job_stopped()):
        stop.leave()  # (a rank whose run ended as a peer's stop ended it, before it heard of the stop)
    sys.stdout.flush()
    sys.stderr.flush()
    shutdown()
    os._exit(0)
