"""Run directories: every launch gets its own, so no run overwrites another.

``run.out_dir`` is a *base* directory. ``dvla train`` (``python -m dvla.launch``) writes
each new run to ``{out_dir}/{YYYYmmdd-HHMMSS}`` (``-2``, ``-3`` ... when that exists), or
to ``{out_dir}/{run.name}`` when a name is given, and points the relative symlink
``{out_dir}/latest`` at it (replaced atomically). ``--resume`` and torchrun restarts
continue the run ``latest`` points to, or ``out_dir`` itself when it already is a run
directory. ``dvla report`` / ``dvla trace`` without an argument find the newest run under
``runs/``. ``Swimlane(cfg)`` used from Python does none of this: it writes to
``cfg.run.out_dir`` exactly.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from dvla.config import ConfigError

log = logging.getLogger("dvla.state.rundir")
LATEST = "latest"
_MARKERS = ("config.yaml", "checkpoints", "metrics.jsonl", "summary.json")


def is_run_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a run (its ``config.yaml`` or ``checkpoints/``)."""
    p = Path(path)
    return (p / "config.yaml").is_file() or (p / "checkpoints").is_dir()


def latest_run(base: str | os.PathLike) -> Path | None:
    """The run ``base/latest`` points to (as ``base/<name>``), or None."""
    link = Path(base) / LATEST
    if link.is_symlink():
        target = Path(os.readlink(link))
        run = target if target.is_absolute() else Path(base) / target
        return run if run.is_dir() else None
    if link.is_dir():  # a filesystem without symlinks: a real directory named latest
        return link
    return None


def point_latest(base: str | os.PathLike, run: str | os.PathLike) -> None:
    """Make ``base/latest`` a relative symlink to ``run`` (a directory in ``base``),
    replacing the old link atomically; warn where symlinks are not possible."""
    base, run = Path(base), Path(run)
    link = base / LATEST
    tmp = base / f".{LATEST}.{os.getpid()}.tmp"
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(os.path.relpath(run, base), tmp)
        os.replace(tmp, link)
    except OSError as exc:
        log.warning("could not point %s at %s: %s", link, run, exc)
        try:
            tmp.unlink()
        except OSError:
            pass


def new_run_dir(base: str | os.PathLike, name: str = "", now: float | None = None) -> Path:
    """Create this run's directory under ``base`` (``name``, or a timestamp made unique with
    a ``-N`` suffix), point ``base/latest`` at it and return it. A ``name`` that already
    holds a run is a :class:`ConfigError` (``--resume`` continues it)."""
    base = Path(base)
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run.out_dir: cannot create {base}: {exc.strerror or exc}") from None
    if not base.is_dir():
        raise ConfigError(f"run.out_dir: {base} is not a directory")
    if name:
        run = base / name
        if is_run_dir(run):
            raise ConfigError(f"run.name: {run} already holds a run; continue it with --resume, or choose "
                              "another run.name")
        _mkdir(run, exist_ok=True)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        for i in itertools.count(1):
            run = base / (stamp if i == 1 else f"{stamp}-{i}")
            try:
                _mkdir(run)
                break
            except FileExistsError:
                continue
    point_latest(base, run)
    return run


def _mkdir(run: Path, exist_ok: bool = False) -> None:
    """Create a run directory; one that cannot be written (read-only, permissions, a full
    disk) is a :class:`ConfigError` naming ``run.out_dir``."""
    try:
        run.mkdir(exist_ok=exist_ok)
    except FileExistsError:
        raise
    except OSError as exc:
        raise ConfigError(f"run.out_dir: cannot create the run directory {run}: {exc.strerror or exc} "
                          "(choose a directory this user can write, e.g. run.out_dir=runs/NAME)") from None


def has_checkpoint(run: str | os.PathLike) -> bool:
    """Whether ``run`` holds a (final-named) checkpoint."""
    from dvla.state.checkpoint import CheckpointManager

    return bool(CheckpointManager(Path(run) / "checkpoints").list())


def newest_run_with_checkpoint(base: str | os.PathLike) -> Path | None:
    """The newest run directly in ``base`` that holds a checkpoint (by modification time),
    or None: what ``--resume`` continues when ``latest`` points at a run that saved none
    (one that crashed early)."""
    base = Path(base)
    if not base.is_dir():
        return None
    runs = [p for p in base.iterdir() if p.is_dir() and not p.is_symlink() and p.name != LATEST
            and has_checkpoint(p)]
    return max(runs, key=_mtime) if runs else None


def _holds_results(run: Path) -> bool:
    metrics = run / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return True
    if any((run / name).exists() for name in ("weights.safetensors", "summary.json")):
        return True
    checkpoints = run / "checkpoints"
    return checkpoints.is_dir() and any(checkpoints.iterdir())


def discard_new_run(base: str | os.PathLike, run: str | os.PathLike, previous: Path | None) -> None:
    """Undo :func:`new_run_dir` for a run that failed before it learned anything (no metrics
    row, checkpoint, weights or summary; what its start wrote, such as ``config.yaml``, goes
    with it): remove its directory and point ``latest`` back at ``previous`` (or remove it)."""
    base, run = Path(base), Path(run)
    if not run.is_dir() or _holds_results(run):
        return
    shutil.rmtree(run, ignore_errors=True)
    if run.exists():
        return
    if latest_run(base) is None and (base / LATEST).is_symlink():
        if previous is not None and previous.is_dir():
            point_latest(base, previous)
        else:
            try:
                (base / LATEST).unlink()
            except OSError:
                pass


def resume_run_dir(base: str | os.PathLike, name: str = "") -> Path | None:
    """The run to continue: ``base/name`` when a name is given, else the run ``base/latest``
    points to, else ``base`` itself when it is a run directory; None when there is none."""
    base = Path(base)
    if name:
        return base / name if (base / name).is_dir() else None
    latest = latest_run(base)
    if latest is not None:
        return latest
    return base if is_run_dir(base) else None


def choose_run_dir(base: str | os.PathLike, name: str = "", resume: bool = False,
                   restarted: bool = False) -> tuple[Path, bool]:
    """The directory this launch writes to and whether it continues an existing run.
    ``resume`` (``--resume``) requires a run to continue; a torchrun restart
    (``restarted``) continues one where there is one, else starts a new one."""
    if resume or restarted:
        run = resume_run_dir(base, name)
        if run is not None:
            if run.parent == Path(base):  # latest: the run written to last
                point_latest(base, run)
            return run, True
        if resume:
            where = f"{Path(base) / name}" if name else f"{base} (no {Path(base) / LATEST}, and it is not a run directory)"
            raise ConfigError(f"--resume: no run to continue in {where}; start a new run without --resume")
    return new_run_dir(base, name), False


def resolve_run_arg(path: str | os.PathLike) -> Path:
    """A run directory from what a user typed: a base directory with ``latest`` means
    its latest run; anything else is taken as given."""
    p = Path(path)
    return latest_run(p) or p


def _mtime(run: Path) -> float:
    times = [run.stat().st_mtime]
    for m in _MARKERS:
        try:
            times.append((run / m).stat().st_mtime)
        except OSError:
            pass
    return max(times)


def find_latest_run(root: str | os.PathLike = "runs") -> Path | None:
    """The newest run under ``root``: each base directory's ``latest`` run, and run
    directories directly in ``root`` or one level down, newest by modification time."""
    root = Path(root)
    if not root.is_dir():
        return None
    found: set[Path] = set()
    candidates = [root] + sorted(p for p in root.iterdir() if p.is_dir() and p.name != LATEST)
    for d in candidates:
        latest = latest_run(d)
        if latest is not None:
            found.add(latest)
        elif d is not root and is_run_dir(d):
            found.add(d)
    if not found:
        return None
    return max(found, key=_mtime)


# -- what a resume may change ---------------------------------------------------------------

RESUME_REFUSES = ("env.name", "env.n_envs", "env.episode_len", "env.image_size", "env.reward_shaping",
                  "env.success_reward", "env.options", "env.options.", "env.rank_options", "env.rank_options.", "policy.", "algo.name",
                  "algo.group_size", "run.seed")
"""Config fields (or sections, ending in a dot) a resume may not change: the model and its
checkpointed state, what an episode and a chunk are, the algorithm, the seed."""
RESUME_IGNORES = ("run.out_dir", "run.name", "run.resume", "policy.init")
"""Fields that only say where the run is and how it was started (``policy.init``: a resume
continues from its checkpoint, whatever weights the run started from)."""


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def check_resume_config(old: dict[str, Any], new: dict[str, Any], done: int) -> list[str]:
    """Compare the config a resume asks for (``new``) with the checkpoint's (``old``, which
    is at update ``done``). A change that cannot continue (:data:`RESUME_REFUSES`), or
    ``run.iterations`` not above ``done``, is a :class:`ConfigError` naming it; returns the
    other fields that changed, as ``"key: old -> new"`` lines to log."""
    a, b = _flat(old), _flat(json.loads(json.dumps(new)))  # as a manifest holds it (tuples are lists)
    changed = [k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k) and k not in RESUME_IGNORES]
    refused = [k for k in changed if any(k == r or (r.endswith(".") and k.startswith(r)) for r in RESUME_REFUSES)]
    # (a section emptied or filled: "env.options" {} against "env.options.x")
    if refused:
        diffs = "; ".join(f"{k}: {a.get(k)!r} in the checkpoint, {b.get(k)!r} now" for k in refused)
        raise ConfigError(f"--resume cannot change {', '.join(refused)} ({diffs}): the checkpoint's model and "
                          "episodes depend on it; resume with the run's own values, or start a new run")
    if int(b.get("run.iterations", 0)) <= done:
        raise ConfigError(f"--resume: run.iterations={b.get('run.iterations')} but the checkpoint is at update "
                          f"{done} already; ask for more (run.iterations={done + 1} or above)")
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed]


def check_resume(cfg, checkpoints: list[Path]) -> None:
    """Compare ``cfg`` with the config of the newest readable checkpoint's manifest
    (:func:`check_resume_config`): a ConfigError for a change that cannot continue, a log
    line for each other change."""
    for path in reversed(checkpoints):
        try:
            manifest = json.loads((path / "manifest.json").read_text())
            old, done = manifest["config"], int(manifest["version"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # damaged: loading falls back to an older one as well
        for line in check_resume_config(old, cfg.to_dict(), done):
            log.info("--resume: changed since the checkpoint: %s", line)
        return


def pick_run_dir(base: str | os.PathLike, cfg, restarts: int, unit: str = "updates") -> tuple[Path, bool, Path | None]:
    """``(run directory, whether it continues a run, the previous latest run)`` for a job
    writing under ``base`` (an RL run, ``dvla sft``): ``--resume`` continues ``base/latest``
    (or ``base/run.name``; a latest run that crashed before its first checkpoint gives way to
    the newest run with one) and needs a checkpoint there whose config this one may continue
    (:func:`check_resume`); a torchrun restart (``restarts > 0``) continues the run where
    there is one. ``unit``: what ``run.save_every`` counts, for the error."""
    from dvla.state.checkpoint import CheckpointManager

    previous = latest_run(base)
    if cfg.run.resume and restarts == 0 and not cfg.run.name and previous is not None \
            and not has_checkpoint(previous):
        other = newest_run_with_checkpoint(base)
        if other is not None:
            log.info("--resume: %s (latest) saved no checkpoint; continuing %s, the newest run with one",
                     previous, other)
            point_latest(base, other)
    run, resumed = choose_run_dir(base, cfg.run.name, resume=cfg.run.resume, restarted=restarts > 0)
    if cfg.run.resume and restarts == 0:
        checkpoints = CheckpointManager(run / "checkpoints").list()
        if not checkpoints:
            raise ConfigError(f"--resume: no checkpoint in {run / 'checkpoints'} (that run saved none; "
                              f"run.save_every=N writes one every N {unit})")
        check_resume(cfg, checkpoints)  # a ConfigError for a change that cannot continue
    return run, resumed, previous
