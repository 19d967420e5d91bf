"""A run's checkpoints: what rank 0 saves (weights, the KL reference, optimizer and RNG
state, counters, config, the policy's normalisation) and what every learner restores on
``run.resume`` or after torchrun restarted its group (see :mod:`dvla.state.checkpoint` for the
files; the normalisation every rank then installs: :func:`swimlane.assembly.build.share_normalization`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dvla.state.checkpoint import CheckpointError, CheckpointManager, section
from dvla.config import ConfigError
from dvla.normalize import METADATA_KEY as NORM_KEY
from dvla.distributed.sharding import full_tensor
from dvla.state.train_state import load_optimizer_state, optimizer_state, rng_state, set_rng_state

log = logging.getLogger("dvla.swimlane")


@dataclass
class Resumed:
    version: int
    env_steps: int
    counters: dict[str, int]
    path: Path
    manifest: dict[str, Any] = field(default_factory=dict, repr=False)  # the checkpoint's (its normalisation)


class RunCheckpoints:
    def __init__(self, manager: CheckpointManager, policy: torch.nn.Module, algo,
                 generators: dict[str, torch.Generator]):
        self.manager, self.policy, self.algo, self.generators = manager, policy, algo, generators

    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's (and the KL reference's) tensors, as a checkpoint names them."""
        tensors = {f"policy/{k}": v for k, v in self.policy.state_dict().items()}
        ref = getattr(self.algo, "reference", None)
        if ref is not None:
            tensors.update({f"reference/{k}": v for k, v in ref.state_dict().items()})
        return tensors

    def state(self, version: int, manifest: dict[str, Any],
              keep: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The run's state at ``version`` as a checkpoint holds it: tensors and manifest. A
        sharded learner's tensors are gathered whole, one at a time, into host memory (a
        collective: every learner calls it); ``keep=False`` drops each after its gather (a
        learner that only takes part)."""
        opt_t, opt_meta = optimizer_state(self.algo.optimizer)
        rng_t, rng_meta = rng_state(self.generators)
        tensors = {}
        for k, v in [*self.weights().items(), *opt_t.items()]:
            whole = full_tensor(v)
            if k.startswith("policy/") and whole.is_floating_point() and not bool(torch.isfinite(whole).all()):
                raise RuntimeError(f"the weights of version {version} hold NaN or inf ({k[7:]}): no checkpoint "
                                   "written, stopping; the newest checkpoint holds the last good weights")
            if keep:
                tensors[k] = whole.cpu() if whole is not v else v
        norm = getattr(self.policy, "normalizer", None)  # (dvla.normalize: null where the run has none)
        return ({**tensors, **rng_t}, {"version": version, **manifest, "optimizer": opt_meta, "rng": rng_meta,
                                       NORM_KEY: norm.to_json() if norm is not None else None})

    def save(self, version: int, manifest: dict[str, Any], write: bool = True) -> None:
        """Write version ``version``; ``manifest`` adds the run's own entries (counters,
        env steps, restarts, config). ``write=False``: a sharded learner other than rank 0,
        which only takes part in gathering the state."""
        state = self.state(version, manifest, keep=write)
        if write:
            self.manager.save(version, *state)

    def load_weights(self, t: dict[str, torch.Tensor]) -> None:
        self.policy.load_state_dict(section(t, "policy/"))
        ref = getattr(self.algo, "reference", None)
        if ref is not None:
            ref.load_state_dict(section(t, "reference/"))

    def restore(self, t: dict[str, torch.Tensor], m: dict[str, Any], path: Path) -> Resumed:
        """Load a state (from :meth:`state`, or a checkpoint) into the policy, reference,
        optimizer and generators."""
        self.load_weights(t)
        load_optimizer_state(self.algo.optimizer, t, m["optimizer"])
        set_rng_state(t, m["rng"], self.generators)
        return Resumed(int(m["version"]), int(m["env_steps"]), m["counters"], path, m)

    def resume(self, restarts: int, required: bool = True) -> Resumed | None:
        """Load the newest valid checkpoint into the policy, reference, optimizer and
        generators. None when there is none on a restart (start from the beginning);
        a requested resume without one is a ConfigError."""
        try:
            ck = self.manager.load_latest()
        except CheckpointError:  # every one is damaged (each logged by the manager)
            tried = "; ".join(f"{Path(p).name}: {why.split(': ', 1)[-1]}" for p, why in self.manager.skipped[:4])
            more = f" and {len(self.manager.skipped) - 4} more" if len(self.manager.skipped) > 4 else ""
            raise ConfigError(f"run.resume: no valid checkpoint in {self.manager.directory}: all "
                              f"{len(self.manager.skipped)} tried are damaged ({tried}{more})") from None
        if ck is None:
            if restarts == 0 and required:
                raise ConfigError(f"run.resume: no checkpoint in {self.manager.directory}")
            if required:
                log.warning("restart %d: no checkpoint yet, starting from the beginning", restarts)
            return None
        return self.restore(ck.tensors, ck.manifest, ck.path)


def resume_learner(checkpoints: RunCheckpoints, *, resume: bool, restarts: int, rank: int, learner_ranks: int,
                   agree_on=None) -> Resumed | None:
    """The learner's starting state: the newest checkpoint when resuming (None: start
    fresh). With several learners ``agree_on(got, error)`` makes them agree on rank 0's
    (:func:`swimlane.agreement.start.agree`); a learner other than rank 0 may not see the
    checkpoints, and rank 0 sends them."""
    got, error = None, None
    try:
        if resume:
            got = checkpoints.resume(restarts, required=rank == 0)
    except ConfigError as exc:
        if learner_ranks == 1:
            raise
        error = str(exc)
    return agree_on(got, error) if learner_ranks > 1 else got
