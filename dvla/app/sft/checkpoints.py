"""``dvla sft``'s checkpoints, with the RL run's conventions (its run directory is chosen as an
RL run's is, :func:`dvla.app.run.share_run_dir`).

Every ``run.save_every`` steps and at the end, rank 0
writes a checkpoint (:class:`SFTCheckpoints`, :class:`dvla.state.checkpoint.CheckpointManager`:
atomic, verified, pruned to ``run.keep_checkpoints``) that holds the whole model (gathered
from the shards when they are sharded), the optimizer's state, the step, the config, the
normalisation, and every rank's random-number generators; a resume loads the newest that
verifies (falling back past damaged ones), on rank 0, which sends it to the others, so that
the run goes on exactly as if it had never stopped."""

from __future__ import annotations

import base64
from pathlib import Path

import torch

from dvla.state.checkpoint import CheckpointError, CheckpointManager, all_finite, section
from dvla.app.run import RelayedError
from dvla.config import ConfigError
from dvla.distributed import all_gather_json, broadcast_json, broadcast_tensors, tensor_layout
from dvla.normalize import METADATA_KEY as NORM_KEY
from dvla.distributed.sharding import full_tensor
from dvla.state.train_state import load_optimizer_state, optimizer_state, rng_state, set_rng_state

RANK_SEED = 104729  # a rank's random stream (a flow head's noise, dropout): run.seed + RANK_SEED * rank


# -- random-number generators of every rank ---------------------------------------------------


def _rng_json() -> dict:
    """This rank's :func:`dvla.state.train_state.rng_state` as JSON values (tensors in base64)."""
    tensors, meta = rng_state()
    return {"meta": meta, "tensors": {k: [str(v.dtype).removeprefix("torch."),
                                          base64.b64encode(v.contiguous().numpy().tobytes()).decode()]
                                      for k, v in tensors.items()}}


def _set_rng_json(d: dict) -> None:
    tensors = {k: torch.frombuffer(bytearray(base64.b64decode(b)), dtype=getattr(torch, dt)).clone()
               for k, (dt, b) in d["tensors"].items()}
    set_rng_state(tensors, d["meta"])


# -- checkpoints ------------------------------------------------------------------------------


class SFTCheckpoints:
    """Rank 0 writes, every rank takes part (gathering shards, RNG states)."""

    def __init__(self, directory: Path, keep: int, rank: int, world: int, log=print):
        self.manager = CheckpointManager(directory, keep=keep)
        self.rank, self.world, self.log = rank, world, log

    def save(self, step: int, learner, manifest: dict) -> None:
        """Checkpoint ``step``: the whole policy and optimizer state (each sharded tensor
        gathered, one at a time: a collective), every rank's RNG states, ``manifest``."""
        opt_t, opt_meta = optimizer_state(learner.optimizer)
        tensors = {}
        for k, v in [*((f"policy/{k}", v) for k, v in learner.policy.state_dict().items()), *opt_t.items()]:
            whole = full_tensor(v)  # (a shard's gather: a collective, on the communication stream)
            if self.rank == 0:
                tensors[k] = whole.detach().cpu()
        rng_t, rng_meta = rng_state()
        ranks = all_gather_json(_rng_json()) if self.world > 1 else []
        if self.rank != 0:
            return
        if not all_finite(section(tensors, "policy/")):
            raise FloatingPointError(f"dvla sft: the weights of step {step} hold NaN or inf: no checkpoint written")
        self.manager.save(step, {**tensors, **rng_t}, {"version": step, **manifest, "optimizer": opt_meta,
                                                       "rng": rng_meta, "rank_rng": ranks[1:]})

    def _load(self, check) -> tuple[dict | None, dict | None]:
        """Rank 0: the newest valid checkpoint (tensors, manifest), checked by ``check``
        (its manifest -> a ConfigError); (None, None) when there is none."""
        try:
            ck = self.manager.load_latest()
        except CheckpointError as exc:  # (each damaged one logged by the manager)
            newest = self.manager.skipped[0][1] if self.manager.skipped else str(exc)
            raise ConfigError(f"run.resume: no valid checkpoint in {self.manager.directory} "
                              f"(all {len(self.manager.skipped)} damaged; the newest: {newest})") from None
        if ck is None:
            return None, None
        check(ck.manifest)
        self.log(f"dvla sft: resuming from {ck.path} (step {ck.step})")
        return ck.tensors, ck.manifest

    def resume(self, learner, check, seed: int) -> int:
        """Load the newest valid checkpoint into the learner (policy, optimizer, learning
        rates) and every rank's generators; the step to go on from (0: none, start afresh).
        A collective with several ranks: rank 0 reads and sends."""
        if self.world == 1:
            tensors, manifest = self._load(check)
        else:
            head, tensors, manifest = None, None, None
            if self.rank == 0:
                try:
                    tensors, manifest = self._load(check)
                except ConfigError as exc:
                    broadcast_json({"error": str(exc)}, 0)
                    raise
                head = {"manifest": manifest, "tensors": tensor_layout(tensors or {})}
            head = broadcast_json(head, 0)
            if "error" in head:
                raise RelayedError(head["error"])
            manifest = head["manifest"]
            tensors = broadcast_tensors(tensors, head["tensors"]) if manifest is not None else None
        if manifest is None:
            return 0
        learner.policy.load_state_dict(section(tensors, "policy/"))
        load_optimizer_state(learner.optimizer, tensors, manifest["optimizer"])
        learner.restart_lrs()
        ranks = manifest.get("rank_rng") or []
        if self.rank == 0:
            set_rng_state(tensors, manifest["rng"])
        elif self.rank - 1 < len(ranks):
            _set_rng_json(ranks[self.rank - 1])
        else:  # a run saved with fewer ranks: a stream of its own
            torch.manual_seed(seed + RANK_SEED * self.rank + int(manifest["version"]))
        if self.rank == 0 and len(ranks) + 1 != self.world:
            self.log(f"dvla sft: the checkpoint was written by {len(ranks) + 1} rank(s), this run has {self.world}: "
                     "the same global batches; ranks without a saved random stream start a new one")
        return int(manifest["version"])


def sft_check(batch_size: int, action_norm: str, frames: int, norm_json: str):
    """What a resume of an SFT checkpoint may not change, beyond the config's own rules: the
    global batch, the normalisation and the dataset (a ConfigError naming it)."""
    def check(manifest: dict) -> None:
        sft = manifest.get("sft") or {}
        for key, now in (("batch_size", batch_size), ("action_norm", action_norm), ("frames", frames)):
            if key in sft and sft[key] != now:
                flag = {"batch_size": "--batch-size", "action_norm": "--action-norm", "frames": "--data"}[key]
                raise ConfigError(f"--resume cannot change {flag}: the checkpoint has {key} {sft[key]!r}, this run "
                                  f"{now!r} (resume with the run's own, or start a new run)")
        if NORM_KEY in manifest and manifest[NORM_KEY] != norm_json:
            raise ConfigError("--resume: --data's normalisation differs from the checkpoint's (another dataset?): "
                              "resume on the data the run trained on, or start a new run")
    return check
