"""``dvla sft``'s learner: the RL learner (:class:`dvla.algos.base.Algorithm`) with the
imitation loss in place of the policy-gradient one. It keeps the RL learner's learning-rate
schedule, bf16 autocast (``algo.precision``), gradient averaging over ranks
(:func:`dvla.distributed.allreduce_mean_grads`), clipping and skipped non-finite steps, and is
sharded by the RL learner's own code (:func:`dvla.distributed.sharding.shard_learner`, FSDP2
``fully_shard``); only its optimizer is ``dvla sft``'s AdamW.

Several ranks train on a global minibatch together, each on its own share of the frames
(:func:`dvla.datasets.frames.shard`). Each rank's loss is weighted by its share of the global batch's
valid chunk steps before the gradients are averaged, so that a step is the one-process step on
the whole batch whenever the loss is a mean over the valid steps (every built-in head's), even
where the shares differ in size or in masked steps."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dvla.algos.base import Algorithm
from dvla.algos.optim import param_groups, without_dynamo_import
from dvla.config import ConfigError
from dvla.distributed import allreduce_mean_grads, sum_over_group
from dvla.distributed.sharding import checkpoint_activations, shard_learner
from dvla.types import Observation
from memory import runtime


def _synced(params, contributes: bool = True) -> int:
    """The gradients averaged over every rank, on the runtime's communication stream."""
    with runtime.current().collective():
        return allreduce_mean_grads(params, contributes=contributes)


class ImitationLearner(Algorithm):
    """One optimizer step per global minibatch on the policy's ``imitation_loss``."""

    name = "sft"

    def __init__(self, cfg, policy, world: int = 1, horizon: int | None = None):
        super().__init__(cfg, policy, _synced if world > 1 else None)
        self.world, self.horizon = world, horizon

    def build_optimizer(self) -> None:
        """AdamW over the policy's parameter groups (``algo.lr``, ``algo.weight_decay``), as
        ``dvla sft`` has always trained; again after sharding (the parameters are new then)."""
        groups = param_groups(self.policy)
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer = without_dynamo_import(torch.optim.AdamW)(groups, lr=self.cfg.lr,
                                                                 weight_decay=self.cfg.weight_decay)
        self._base_lrs = [g["lr"] for g in self.optimizer.param_groups]

    def restart_lrs(self) -> None:
        """The configured learning rates (``algo.lr`` as it is now) after the optimizer's state
        was restored; a schedule sets each step's own."""
        for g, lr in zip(self.optimizer.param_groups, self._base_lrs):
            g["lr"] = lr

    def advantages(self, batch):
        raise NotImplementedError("the imitation learner learns from demonstrations, not from rollouts")

    def prepare(self, sharded: bool, policy_name: str) -> None:
        """What the RL learner becomes once its starting state is in place (as
        ``swimlane.assembly.build.prepare_learner``): activation checkpointing
        (``algo.activation_checkpointing``), then FSDP2 shards over every rank."""
        if self.cfg.activation_checkpointing:
            try:
                checkpoint_activations(self.policy)
            except ValueError as exc:
                raise ConfigError(f"policy.name={policy_name}: {exc}") from None
        if sharded:
            shard_learner(self, dist.group.WORLD)

    def imitation_step(self, obs: Observation, chunks: torch.Tensor, valid: torch.Tensor, share: float,
                       step: int) -> dict[str, float]:
        """Step ``step`` on this rank's part of the global minibatch: ``share`` is its part of
        the global batch's valid chunk steps (1 in one process). Returns the global batch's
        loss and stats, the gradient's norm, whether the step was skipped (a gradient that is
        not finite) and the learning rate."""
        self.schedule_lr(step)
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            loss, stats = self.policy.imitation_loss(obs, chunks, valid)
        part = {"loss": float(loss.detach()) * share, **{k: float(v) * share for k, v in stats.items()}}
        total = sum_over_group(part) if self.world > 1 else part  # (every rank stops together)
        if not math.isfinite(total["loss"]):
            raise FloatingPointError(f"dvla sft: the imitation loss is {total['loss']} at step {step}")
        (loss * (share * self.world)).backward()  # averaged over the ranks: the whole batch's mean
        out = self._apply_gradients({})
        return {**total, **out, "lr": self.optimizer.param_groups[0]["lr"]}


def sharded(cfg, world: int) -> bool:
    """Whether the ranks shard the model (``algo.shard``, resolved as for RL learners: every
    rank of an SFT job is a learner)."""
    return world > 1 and cfg.sharded_learners


def device_of(cfg, world: int) -> torch.device:
    """The rank's device: ``run.device``; under torchrun a rank's own GPU, which it sees as
    ``cuda:0`` (the launcher narrows ``CUDA_VISIBLE_DEVICES``)."""
    name = cfg.run.device
    available = runtime.current().available()
    if name.startswith("cuda") and not available:
        raise ConfigError(f"run.device={name!r} but CUDA is not available on this machine")
    if world > 1 and name.startswith("cuda:") and name != "cuda:0":
        raise ConfigError(f"run.device: {name!r} under torchrun: each rank sees only its own GPU, as cuda:0 "
                          "(use auto or cuda)")
    if name == "auto":
        name = "cuda" if available else "cpu"
    return torch.device("cuda:0" if world > 1 and name == "cuda" else name)


__all__ = ["ImitationLearner", "device_of", "sharded"]
