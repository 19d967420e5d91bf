"""Policy-gradient learner shared by GRPO and PPO.

An :class:`Algorithm` turns a :class:`RolloutBatch` into per-step advantages (the
part that differs between algorithms) and then runs the common update: several
epochs of shuffled minibatches over the valid steps, clipped surrogate, optional
extra loss terms, gradient averaging across learner ranks, norm clipping.

The surrogate is the decoupled PPO objective (:func:`clipped_policy_loss`): on-policy
data uses the behaviour log-probs as the proximal ones, which is exactly PPO. Stale data
(sampled by weights older than the learner's, as the asynchronous swimlane produces)
gets proximal log-probs recomputed with the learner's weights at the start of the
update (steps of a mixed batch that the current weights sampled keep their behaviour
log-probs, which are the proximal ones): the trust region is then taken around the
current policy and the lag between behaviour and proximal policy is corrected by a
truncated importance weight (``algo.max_is_weight``).

``algo.proximal=loglinear`` approximates the proximal log-probs instead of recomputing
them (the approximation of AReaL's ``prox_logp_method=loglinear``, A-3PO): a step sampled
``lag`` versions before the learner's weights ``V`` lies, by version, ``lag / (lag + 1)`` of
the way from its behaviour policy to the policy being trained (``V + 1``), so
``log pi_prox = log pi_behav + lag / (lag + 1) * (log pi_theta - log pi_behav)``, with
``log pi_theta`` the training forward pass's own log-prob (no gradient through it). Fresh
steps get ``lag = 0``: plain PPO, as with ``recompute``. It saves the extra forward pass.

Behaviour log-probs computed with other numerics than the learner's (bf16 inference
replicas, ``swimlane.publish_dtype=bf16``, against an fp32 learner; or fp32 replicas against
``algo.precision=bf16``) are not the learner's log-probs even at identical weights: the
ratio ``pi_theta / pi_behav`` of a fresh step would carry the rounding gap, summed over every
action dimension of a joint ratio, and clip for no reason. The learner is told the
replicas' dtype (``behaviour_dtype``); when the numerics differ it recomputes the proximal
log-probs of *every* step (whatever ``algo.proximal`` says), in its own numerics, so that
the clipped ratio ``pi_theta / pi_prox`` is 1 at unchanged weights and the precision gap
lands in the truncated importance weight ``pi_prox / pi_behav`` (``algo.max_is_weight``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from dvla.algos.guards import kl_over_group, lr_factor
from dvla.algos.losses import clipped_policy_loss, masked_mean
from dvla.algos.optim import adam, all_reduce_small, collective_device, param_groups
from dvla.config import AlgoConfig, ConfigError
from dvla.policy import VLAPolicy
from dvla.distributed.sharding import full_tensor, is_dtensor, reshard
from dvla.types import CAMERAS_PREFIX, EXTRAS_PREFIX, Observation, RolloutBatch

__all__ = ["Algorithm", "GradSync", "collective_device", "extras_of", "obs_of", "param_groups"]

_PROXIMAL_INPUTS = ("image", "proprio", "ids", "ids_mask", "actions", "action_valid", "behav_logp")


def obs_of(mb: dict[str, Tensor]) -> Observation:
    """The (prepared) observations of a flattened minibatch."""
    n = len(CAMERAS_PREFIX)
    return Observation(image=mb["image"], proprio=mb["proprio"], instruction_ids=mb["ids"],
                       instruction_mask=mb["ids_mask"],
                       cameras={k[n:]: v for k, v in mb.items() if k.startswith(CAMERAS_PREFIX)})


def extras_of(mb: dict[str, Tensor]) -> dict[str, Tensor]:
    """The rollout extras of a flattened minibatch (``extras.<name>`` entries)."""
    n = len(EXTRAS_PREFIX)
    return {k[n:]: v for k, v in mb.items() if k.startswith(EXTRAS_PREFIX)}


GradSync = Callable[..., int]
"""``sync(params, contributes=...)``: average the gradients over the learners (in place);
returns how many were averaged over (0: skip the step). ``contributes`` is false where this
learner has no samples in the step (:func:`dvla.distributed.allreduce_mean_grads`)."""


class Algorithm(ABC):
    name: str

    def __init__(self, cfg: AlgoConfig, policy: VLAPolicy, grad_sync: GradSync | None = None,
                 behaviour_dtype: torch.dtype | None = None):
        self.cfg = cfg
        self.policy = policy
        # The dtype of the weights that sample the rollouts (the inference replicas,
        # swimlane.publish_dtype); None: the learner's own numerics.
        self.behaviour_dtype = behaviour_dtype
        self.build_optimizer()
        self.grad_sync = grad_sync
        # The learners' group when they are sharded (dvla/distributed/sharding.py): every rank then makes
        # the same number of forward and backward passes per update, padding with empty ones.
        self.shard_group = None
        self._totals: tuple[float, float] | None = None  # (samples, counted entries) of the minibatch, when micro-batched
        self._passes = 1  # forward and backward passes per minibatch, on every rank (sharded)
        self._dummy: dict[str, Tensor] | None = None  # a row for the padding passes (sharded)
        # The learners' group when several replicas average gradients (grad_sync): the target-KL
        # stop is decided over it (or over shard_group). horizon: run.iterations, for the
        # learning-rate schedules (dvla/algos/guards.py).
        self.learner_group = None
        self.horizon: int | None = None
        self._updates = 0  # updates so far, where the caller gives no learner_version
        self._stopping = False  # the target KL was crossed: skip the rest of the update

    @property
    def behaviour_exact(self) -> bool:
        """Whether the behaviour log-probs are what the learner itself computes at the same
        weights: only when both sides run fp32 (or nobody said otherwise: ``behaviour_dtype``
        None). A bf16 replica holds rounded weights and samples under bf16 autocast; a bf16
        learner (``algo.precision``) keeps fp32 master weights and runs some ops in fp32:
        neither matches the other, nor an fp32 side, to the bit."""
        if self.behaviour_dtype is None:
            return True
        return self.behaviour_dtype == torch.float32 and self.cfg.precision == "fp32"

    def build_optimizer(self) -> None:
        """The optimizer over the policy's parameter groups (again after sharding: the
        parameters are new objects then)."""
        groups = param_groups(self.policy)
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer = adam(groups, lr=self.cfg.lr, eps=1e-5, weight_decay=self.cfg.weight_decay)
        self._base_lrs = [g["lr"] for g in self.optimizer.param_groups]  # what algo.lr_schedule scales

    def schedule_lr(self, learner_version: int | None = None) -> float | None:
        """Set the learning rate of the update about to run (``algo.lr_schedule``, ``lr_warmup``;
        update ``learner_version``, else the count of updates so far); its factor, None where no
        schedule is set (the rate stays as built)."""
        u = self._updates if learner_version is None else learner_version
        self._updates = u + 1
        c = self.cfg
        if c.lr_schedule == "constant" and not c.lr_warmup:
            return None
        horizon = c.lr_horizon or self.horizon
        if not horizon and c.lr_schedule != "constant":
            raise ConfigError(f"algo.lr_schedule: {c.lr_schedule} needs a horizon: algo.lr_horizon, or run.iterations "
                              f"(given by the swimlane)")
        f = lr_factor(c.lr_schedule, u, horizon or 0, c.lr_warmup)
        for g, lr in zip(self.optimizer.param_groups, self._base_lrs):
            g["lr"] = lr * f
        return f

    def _kl_crossed(self, kl: float, samples: float) -> bool:
        """Whether the minibatch's approximate KL, averaged over the learner ranks, is above
        ``algo.target_kl`` (a collective where there are several: every rank calls it at every
        minibatch, with 0 samples where it has none). Sets ``_stopping``."""
        if self.cfg.target_kl > 0:
            group = self.shard_group if self.shard_group is not None else self.learner_group
            self._stopping = kl_over_group(kl * samples, samples, group, self.policy.device) > self.cfg.target_kl
        return self._stopping

    @abstractmethod
    def advantages(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """Per-step ``(advantages, returns)``, each ``(T, B)``."""

    def extra_loss(self, mb: dict[str, Tensor], out) -> tuple[Tensor, dict[str, Tensor]]:
        """Algorithm-specific loss terms added to the policy loss."""
        return torch.zeros((), device=mb["adv"].device), {}

    def _flatten(self, batch: RolloutBatch, adv: Tensor, ret: Tensor,
                 at: tuple[Tensor, Tensor] | None = None) -> dict[str, Tensor]:
        """The valid steps (or the steps ``at``: time and env indices) as one row each."""
        t_idx, b_idx = batch.valid.nonzero(as_tuple=True) if at is None else at
        return {
            "image": batch.image[t_idx, b_idx],
            "proprio": batch.proprio[t_idx, b_idx],
            "ids": batch.instruction_ids[b_idx],
            "ids_mask": batch.instruction_mask[b_idx],
            "actions": batch.actions[t_idx, b_idx],
            "action_valid": batch.action_valid[t_idx, b_idx],
            "behav_logp": self._behaviour(batch)[t_idx, b_idx],
            "adv": adv[t_idx, b_idx],
            "ret": ret[t_idx, b_idx],
            "old_value": batch.values[t_idx, b_idx],
            **{CAMERAS_PREFIX + k: v[t_idx, b_idx] for k, v in batch.cameras.items()},
            **{EXTRAS_PREFIX + k: v[t_idx, b_idx] for k, v in batch.extras.items()},
        }

    def _behaviour(self, batch: RolloutBatch) -> Tensor:
        """Behaviour log-probs at ``algo.ratio``'s granularity: (T, B), (T, B, K) or (T, B, K, D)."""
        if self.cfg.ratio == "joint":
            return batch.log_probs
        return batch.action_log_probs.sum(-1) if self.cfg.ratio == "step" else batch.action_log_probs

    def _mask(self, mb: dict[str, Tensor], like: Tensor) -> Tensor | None:
        """Which entries of log-probs shaped ``like`` count (None: all of a joint ratio)."""
        if like.dim() == 1:
            return None
        m = mb["action_valid"]
        return m if like.dim() == 2 else m.unsqueeze(-1).expand_as(like)

    def _evaluate(self, part: dict[str, Tensor]):
        return self.policy.evaluate(obs_of(part), part["actions"], part["action_valid"], self.cfg.ratio,
                                    extras_of(part))

    @torch.no_grad()
    def proximal_log_probs(self, data: dict[str, Tensor], chunk: int, passes: int = 0) -> Tensor:
        """Log-probs of the recorded actions under the current weights (no gradient), in
        forward passes of ``chunk`` steps. The update passes its minibatch size (its micro-batch
        size, ``algo.micro_batch``, where smaller): a batch the training step's forward pass
        already handles, and faster than one large pass (the
        activations of a few hundred steps stay in cache: for the tiny VLA on a 2-core CPU,
        935 steps took about twice as long in one pass as in passes of 256). ``passes``:
        at least that many forward passes, padded with discarded ones (sharded learners)."""
        self.policy.eval()
        out = []
        rows = data["actions"].shape[0]
        # Under the training passes' autocast (algo.precision): the proximal policy is computed
        # as the trained one is, or the ratio would not be 1 at unchanged weights.
        with self._autocast():
            for s in range(0, rows, chunk):
                out.append(self._evaluate({k: v[s : s + chunk] for k, v in data.items()}).log_probs.float())
            for _ in range(len(out), passes):
                self._evaluate(self._dummy)
        return torch.cat(out) if out else data["behav_logp"][:0].clone()

    def _pass_rows(self, n_all: int) -> int:
        """What a training pass holds: a minibatch of the largest share, or a micro-batch
        (``algo.micro_batch``) where smaller."""
        rows = -(-n_all // self.cfg.minibatches)
        return min(rows, self.cfg.micro_batch or rows)

    def _agree(self, *counts: int) -> list[int]:
        """The largest of each count over the sharded learners (the counts as they are
        otherwise)."""
        if self.shard_group is None:
            return list(counts)
        got = all_reduce_small(counts, torch.int64, self.shard_group, self.policy.device, dist.ReduceOp.MAX)
        return [int(c) for c in got]

    def update(self, batch: RolloutBatch, generator: torch.Generator | None = None,
               learner_version: int | None = None) -> dict[str, float]:
        """Learn from one batch; returns averaged diagnostics.

        ``learner_version``: the version of the weights being trained. Steps recorded with
        an older ``policy_version`` make the update off-policy: proximal log-probs are
        recomputed (or interpolated, ``algo.proximal``) and the importance weights
        truncated (see the module docstring).
        Without it (or when every step is current) the update is plain on-policy PPO, unless
        the behaviour log-probs come from other numerics than the learner's
        (:attr:`behaviour_exact`): then every step's proximal log-prob is recomputed.
        """
        device = self.policy.device
        lr_f = self.schedule_lr(learner_version)
        batch = batch.to(device)
        adv, ret = self.advantages(batch)
        data = self._flatten(batch, adv, ret)
        n = data["adv"].shape[0]
        stale = None
        if learner_version is not None:
            lag = (learner_version - batch.policy_version[batch.valid]).float()
            stale = lag != 0
        recompute_all = not self.behaviour_exact  # bf16 replicas: no step has its proximal log-prob
        n_all, stale_all = self._agree(n, int(stale.sum()) if stale is not None else 0)
        if n_all == 0:
            return {"samples": 0.0, **_finite_flag(self._follow())}
        if self.shard_group is not None:  # every rank makes the passes of the largest share
            first = torch.zeros(1, dtype=torch.long, device=device)
            self._dummy = self._flatten(batch, adv, ret, at=(first, first))
            size = -(-n_all // self.cfg.minibatches)
            self._passes = -(-size // self.cfg.micro_batch) if self.cfg.micro_batch else 1
        extra: dict[str, float] = {}
        if stale is not None and n:
            extra = {"staleness_mean": float(lag.mean()), "staleness_max": float(lag.max())}
        # The importance-weight stats come from the loss, minibatch by minibatch.
        if recompute_all or (stale is not None and stale_all):
            if self.cfg.proximal == "loglinear" and not recompute_all:
                data["prox_alpha"] = lag / (lag + 1)  # interpolated in _step, per minibatch
            else:
                # Steps sampled by the learner's current weights, in its own numerics, already
                # have their proximal log-probs: the behaviour ones. Only the stale steps need a
                # forward pass; every step does when the behaviour ran in other numerics
                # (loglinear too: its interpolation starts from the behaviour log-probs and
                # would keep their gap in the clipped ratio).
                chunk = self._pass_rows(n_all)
                need = n_all if recompute_all else stale_all  # the most rows on any learner
                passes = -(-need // chunk) if self.shard_group is not None else 0
                if recompute_all or bool(stale.all()):
                    data["prox_logp"] = self.proximal_log_probs(data, chunk, passes)
                else:
                    prox = data["behav_logp"].clone()
                    rows = stale.nonzero(as_tuple=True)[0]
                    prox[rows] = self.proximal_log_probs(
                        {k: v[rows] for k, v in data.items()
                         if k in _PROXIMAL_INPUTS or k.startswith((EXTRAS_PREFIX, CAMERAS_PREFIX))},
                        chunk, passes)
                    data["prox_logp"] = prox
        self.policy.train(self.cfg.train_mode)  # eval by default: the rollouts' mode (algo.train_mode)
        sums: dict[str, float] = {}
        count = stepped = 0
        self._stopping = False
        for _ in range(self.cfg.update_epochs):
            if self._stopping:  # algo.target_kl: the rest of the update's epochs are skipped
                break
            perm = torch.randperm(n, generator=generator).to(device)
            # Always ``minibatches`` steps per epoch (sizes differ by at most one), so that
            # learner ranks with different numbers of valid steps stay in lock-step in
            # their gradient all-reduce.
            for idx in torch.tensor_split(perm, self.cfg.minibatches):
                if idx.numel() == 0:
                    self._empty_step()
                else:
                    stats = self._step({k: v[idx] for k, v in data.items()})
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + v
                    count += 1
                if self._stopping:
                    break
                stepped += 1
        self.policy.eval()
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out["samples"] = float(n)
        out.update(_finite_flag(self._distribution_finite(data, min(n, self._pass_rows(n_all)))))
        if self.cfg.target_kl > 0:  # the step that crossed the target is not taken (its stats count)
            out.update(kl_early_stop=float(self._stopping), minibatches_stepped=float(stepped))
        if lr_f is not None:
            out["lr"] = self.optimizer.param_groups[0]["lr"]
        if n == 0:  # a sharded learner whose share was empty: it made padding passes only
            return out
        out["adv_mean"] = float(adv[batch.valid].mean())
        out["adv_std"] = float(adv[batch.valid].std()) if n > 1 else 0.0
        out.update(extra)
        return out

    def follow(self, learner_version: int | None = None) -> dict[str, float]:
        """An update without samples, on a learner of several: take part in each of its
        optimizer steps (``update_epochs`` x ``minibatches``, fewer where the target KL stops
        it) with no gradient of its own, and apply the others' averaged gradient at the same
        learning rate, so its weights and optimizer state stay those of the learners that had
        samples (a learner that switches roles, ``swimlane.roles``). Returns the update's
        diagnostics that concern this learner too (``non_finite_distribution``)."""
        self.schedule_lr(learner_version)
        return _finite_flag(self._follow())

    def _follow(self) -> bool:
        """The steps of an update without samples; whether the learners' distributions
        stayed finite (:meth:`_distribution_finite`, where this learner has nothing to check)."""
        if self.grad_sync is None:
            return True
        self._stopping = False
        for _ in range(self.cfg.update_epochs * self.cfg.minibatches):
            self._empty_step()
            if self._stopping:
                break
        return self._agree_finite(True)

    @torch.no_grad()
    def _distribution_finite(self, data: dict[str, Tensor], rows: int) -> bool:
        """Whether the updated weights still give a finite distribution (the log-probs of the
        recorded actions and the entropy) on the first ``rows`` steps of the batch they just
        learned from, agreed over the learners. Finite weights can still overflow it (a
        log-std pushed to 100, logits 1e38 apart); such weights must never be published.
        One forward pass, under the training passes' autocast; a sharded learner without
        rows makes a padding pass, as every learner must take part in FSDP's gathers."""
        ok = True
        with self._autocast():
            if rows:
                got = self._evaluate({k: v[:rows] for k, v in data.items()})
                ok = bool(torch.isfinite(got.log_probs).all()) and bool(torch.isfinite(got.entropy).all())
            elif self.shard_group is not None:
                self._evaluate(self._dummy)
        reshard(self.policy)  # (no backward follows: the gathered weights go)
        return self._agree_finite(ok)

    def _agree_finite(self, ok: bool) -> bool:
        """``ok`` on every learner (a collective over the learners where there are several)."""
        group = self.shard_group if self.shard_group is not None else self.learner_group
        if group is None:
            return ok
        return all_reduce_small([int(not ok)], torch.int64, group, self.policy.device, dist.ReduceOp.MAX)[0] == 0

    def _empty_step(self) -> None:
        """A minibatch with no samples (fewer valid steps than minibatches): contribute
        zero gradients to the learner ranks' all-reduce (left out of the average where it is
        masked) and apply the averaged gradient like every other rank, so the replicas stay
        identical."""
        if self.grad_sync is None and self.shard_group is None:
            return
        self.optimizer.zero_grad(set_to_none=True)
        self._totals = None
        if self.shard_group is not None:
            self._pad(self._passes)
        if self._kl_crossed(0.0, 0.0):
            self.optimizer.zero_grad(set_to_none=True)
            return
        if self.grad_sync is not None and not self.grad_sync(self.params, contributes=False):
            self.optimizer.zero_grad(set_to_none=True)  # nobody had samples: no step
            return
        if bool(torch.isfinite(self._clip())):
            self.optimizer.step()  # skipped with the other ranks when their averaged gradient is not finite
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _pad(self, passes: int) -> None:
        """Forward and backward passes that add nothing to the gradient, so that a sharded
        learner with a smaller share takes part in as many collectives as the others."""
        for _ in range(passes):
            with self._autocast():
                loss, _ = self._loss(self._dummy)
            (loss * 0.0).backward()

    def _clip(self) -> Tensor:
        """Clip the gradients' global norm to ``algo.max_grad_norm``; returns the norm before
        (of the whole gradient, over every shard, when sharded)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.shard_group is not None and any(not is_dtensor(p) for p in self.policy.parameters()):
            raise RuntimeError(
                f"sharded learner: FSDP did not reduce-scatter the gradients of {type(self.policy).__qualname__} "
                "(its parameters are still gathered after the backward pass): its forward output exposes no "
                "tensor that requires grad. Keep the distribution's tensors as its attributes (they reach FSDP "
                "as PolicyOutput.backward_anchors)")
        norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros(())
        norm = full_tensor(norm)  # (a sharded gradient's norm: reduced over the shards, a collective)
        torch.nn.utils.clip_grads_with_norm_(self.params, self.cfg.max_grad_norm, norm, foreach=True)
        return norm

    def _total(self, mask: Tensor | None) -> float | None:
        """What a micro-batch's terms divide by: the minibatch's samples, or its counted
        entries with a mask (None: one pass over the whole minibatch, its own count)."""
        return None if self._totals is None else self._totals[1 if mask is not None else 0]

    def mean(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """A loss term's mean over the current minibatch (samples, or the counted entries of
        ``mask``), summed over its micro-batches: each contributes its share."""
        return masked_mean(x, mask, self._total(mask))

    def _autocast(self):
        """bf16 autocast when ``algo.precision=bf16``. A sharded learner's parameters are
        gathered in bf16 already (dvla/distributed/sharding.py); autocast still casts its fp32 inputs and
        keeps the losses' reductions in fp32."""
        return torch.autocast(self.policy.device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16")

    def _step(self, mb: dict[str, Tensor]) -> dict[str, float]:
        """One optimizer step on a minibatch, its gradient accumulated over micro-batches of
        ``algo.micro_batch`` samples."""
        n = mb["adv"].shape[0]
        size = self.cfg.micro_batch or n
        self._totals = None
        if size < n:  # each micro-batch's terms are its share of the minibatch's means
            mask = self._mask(mb, mb["behav_logp"])  # the granularity of the ratio
            self._totals = (float(n), max(float(mask.sum()), 1.0) if mask is not None else float(n))
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for s in range(0, n, size):
            with self._autocast():
                loss, stats = self._loss({k: v[s : s + size] for k, v in mb.items()})
            loss.backward()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        if self.shard_group is not None:
            self._pad(self._passes - -(-n // size))
        if self._kl_crossed(sums.get("approx_kl", 0.0), float(n)):  # algo.target_kl: no step, the update ends
            self.optimizer.zero_grad(set_to_none=True)
            return {**sums, "grad_norm": 0.0, "non_finite_steps": 0.0}
        return self._apply_gradients(sums)

    def _loss(self, mb: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """A micro-batch's share of the minibatch's loss, and of its diagnostics."""
        obs = obs_of(mb)
        out = self.policy.evaluate(obs, mb["actions"], mb["action_valid"], self.cfg.ratio, extras_of(mb))
        mask = self._mask(mb, out.log_probs)
        total = self._total(mask)
        if "prox_alpha" in mb:  # off-policy, proximal log-probs interpolated (algo.proximal=loglinear)
            behav = mb["behav_logp"]
            alpha = mb["prox_alpha"].reshape(-1, *([1] * (behav.dim() - 1)))
            prox = behav + alpha * (out.log_probs.detach() - behav)
            pl, pstats = clipped_policy_loss(out.log_probs, prox, mb["adv"], self.cfg.clip_eps,
                                             behav_log_probs=behav, max_is_weight=self.cfg.max_is_weight, mask=mask,
                                             total=total)
        elif "prox_logp" in mb:  # off-policy: trust region around the proximal policy
            pl, pstats = clipped_policy_loss(out.log_probs, mb["prox_logp"], mb["adv"], self.cfg.clip_eps,
                                             behav_log_probs=mb["behav_logp"],
                                             max_is_weight=self.cfg.max_is_weight, mask=mask, total=total)
        else:
            pl, pstats = clipped_policy_loss(out.log_probs, mb["behav_logp"], mb["adv"], self.cfg.clip_eps,
                                             mask=mask, total=total)
        entropy = self.mean(out.entropy.float())
        extra, estats = self.extra_loss(mb, out)
        loss = pl - self.cfg.entropy_coef * entropy + extra
        stats = {"loss": loss.detach(), "policy_loss": pl.detach(), "entropy": entropy.detach(), **pstats, **estats}
        return loss, stats

    def _apply_gradients(self, sums: dict[str, float]) -> dict[str, float]:
        """Average the accumulated gradients over the learners, clip, step."""
        if self.grad_sync is not None:
            self.grad_sync(self.params, contributes=True)  # this learner has samples: never 0
        grad_norm = self._clip()
        # A NaN or inf loss or gradient must not reach the weights: skip the step. After the
        # all-reduce every learner sees the same norm, so all of them skip it together.
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return {**sums, "grad_norm": float(grad_norm), "non_finite_steps": float(not finite)}


def _finite_flag(ok: bool) -> dict[str, float]:
    """The diagnostic an update reports when its distribution went non-finite (the gradient
    lane then stops before publishing); nothing when it stayed finite."""
    return {} if ok else {"non_finite_distribution": 1.0}
