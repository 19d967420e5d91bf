"""The run's section of the job configuration (``run.*``): length, seeding, device, outputs."""

from __future__ import annotations

from dataclasses import dataclass

from dvla.config.rules import bounded


@dataclass(kw_only=True)
class RunConfig:
    """Length of the run, seeding, device and outputs."""

    iterations: int = bounded(50, ge=1)
    """Learner updates (in sync mode: rollout -> learn -> publish cycles)."""
    seed: int = bounded(0, ge=0, lt=2**63)
    """Seed of weights, envs and sampling."""
    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``."""
    out_dir: str = "runs/dvla"
    """Base directory of runs. Each ``dvla train`` / ``python -m dvla.launch`` writes to a new
    directory ``out_dir/YYYYmmdd-HHMMSS`` (metrics, config, weights, checkpoints, trace,
    ``summary.json``) and points the symlink ``out_dir/latest`` at it; ``--resume`` continues
    ``latest`` (or ``out_dir`` itself when it is a run directory). ``Swimlane(cfg)`` used from
    Python writes to ``out_dir`` itself."""
    name: str = ""
    """Fixed name of the run directory, ``out_dir/name``, instead of a timestamp (for scripts
    and multi-node jobs that need to know it in advance). A new run refuses a name that
    already holds a run; ``--resume`` continues it."""
    progress: bool = True
    """Show a console progress bar (steps/s, success, weights version, staleness, queue
    depth); false: one line per update."""
    tensorboard: bool = True
    """Also write TensorBoard event files to the run directory's ``tb/`` when the ``tensorboard``
    package is installed (``pip install 'dvla[tb]'``)."""
    save_every: int = bounded(0, ge=0)
    """Write a checkpoint (weights, optimizer state, RNG states, counters) to the run
    directory's ``checkpoints/`` every N learner updates (0: only at the end)."""
    keep_checkpoints: int = bounded(3, ge=1)
    """Newest valid checkpoints kept; older ones are pruned."""
    resume: bool = False
    """Continue from the newest valid checkpoint in the run directory's ``checkpoints/``
    (``--resume``: the run ``out_dir/latest`` points to, or ``out_dir/name``). Ranks
    restarted by ``torchrun --max-restarts`` resume on their own."""
    time_limit_s: float = bounded(0.0, ge=0)
    """Stop after this many seconds of training, as if the last iteration had been
    reached (final checkpoint, summary); 0: no limit."""
    torch_threads: int = bounded(0, ge=0, le=2**31 - 1)
    """``torch.set_num_threads`` for this process; 0 keeps PyTorch's default."""
    status_port: int = bounded(-1, ge=-1, le=65535)
    """Serve a live status endpoint on rank 0 (``GET /healthz``, ``/status``, ``/metrics`` in
    Prometheus's text format) on this TCP port; 0 picks a free port; -1 (default): none."""
    status_host: str = "127.0.0.1"
    """The address the status endpoint binds; ``127.0.0.1`` keeps it to this host, ``0.0.0.0``
    opens it to the network (it has no authentication)."""

    def _validate(self) -> list[tuple[str, str]]:
        errs = []
        if self.name and (self.name in (".", "..", "latest") or "/" in self.name or "\\" in self.name
                          or self.name.startswith(".")):
            errs.append(("name", f"must be a plain directory name (no '/', not 'latest' or starting with "
                                 f"'.'), got {self.name!r}"))
        d = self.device
        if not (d in ("auto", "cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit())):
            errs.append(("device", f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {d!r}"))
        return errs
