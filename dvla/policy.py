"""The extension point: :class:`VLAPolicy`, the policy registry and the default tokenizer.

A new Vision-Language-Action model is a subclass of :class:`VLAPolicy` that

* declares ``Config``, a ``@dataclass(kw_only=True)`` of its own options (what
  ``policy.options`` in the job config may set), and
* implements :meth:`VLAPolicy.forward`, mapping a batched :class:`Observation` to a
  :class:`PolicyOutput` (an action distribution and, optionally, a value estimate).

Everything else (sampling with log-probs for rollouts, evaluating log-probs and
entropy for learning, tokenising instructions) is provided here. Register the class
with ``@register_policy("name")`` and select it with ``policy.name=name``.
Mistakes are reported when the class is defined, not deep inside a training run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor, nn

from dvla.config import ConfigError, from_dict, validate
from dvla.distributions import ActionDistribution, ExtraSpec
from dvla.normalize import Normalizer
from dvla.tokenizers import HashTokenizer, Tokenizer, tokenize
from dvla.types import Observation


@dataclass(frozen=True)
class PolicySpec:
    """What the environment promises the policy: observation and action shapes."""

    image_shape: tuple[int, int, int]  # (C, H, W) of the main camera
    proprio_dim: int
    action_dim: int
    action_chunk: int = 1
    cameras: tuple[tuple[str, tuple[int, int, int]], ...] = ()  # further named cameras: (name, (C, H, W))

    @classmethod
    def for_env(cls, env_spec: Any, action_chunk: int = 1) -> "PolicySpec":
        """The spec of a policy acting in an env with ``env_spec`` (a ``dvla.envs.EnvSpec``)."""
        return cls(env_spec.image_shape, env_spec.proprio_dim, env_spec.action_dim, action_chunk,
                   tuple(getattr(env_spec, "cameras", ())))


@dataclass
class PolicyOutput:
    dist: ActionDistribution
    value: Tensor | None = None  # (B,)
    # Set on sharded learners (dvla/distributed/sharding.py): the distribution's tensors, where FSDP looks
    # for the outputs whose gradients start the backward pass of a unit.
    backward_anchors: tuple[Tensor, ...] = ()


@dataclass
class ActOutput:
    actions: Tensor  # (B, K, D) in [-1, 1] (Gaussian samples may exceed it)
    log_probs: Tensor  # (B,)
    values: Tensor  # (B,) zeros when the policy has no value head
    log_prob_elements: Tensor | None = None  # (B, K, D) where the head factorises per dimension
    extras: dict[str, Tensor] = dataclasses.field(default_factory=dict)  # name -> (B, ...), see rollout_extras

    def rows(self, start: int, stop: int) -> "ActOutput":
        """The decisions of envs ``start:stop`` of the batch."""
        el = self.log_prob_elements
        return ActOutput(actions=self.actions[start:stop], log_probs=self.log_probs[start:stop],
                         values=self.values[start:stop], log_prob_elements=el[start:stop] if el is not None else None,
                         extras={k: v[start:stop] for k, v in self.extras.items()})


@dataclass
class EvalOutput:
    log_probs: Tensor  # (B,)
    entropy: Tensor  # (B,)
    values: Tensor | None  # (B,)


class VLAPolicy(nn.Module, ABC):
    """Base class of every policy. Subclass, declare ``Config``, implement ``forward``.

    Pass ``abstract=True`` in the class statement for intermediate base classes that
    leave ``forward`` or ``Config`` to their own subclasses.
    """

    Config: ClassVar[type]
    registry_name: ClassVar[str | None] = None
    has_value_head: bool = False
    """Set to True when ``forward`` returns a value estimate (PPO needs one)."""
    normalizer: Normalizer | None = None
    """The dataset statistics the policy was trained with (``dvla sft``, :mod:`dvla.normalize`):
    proprio normalised where observations enter, actions mapped between the env's space and
    the heads'. None: inputs and actions as they are."""

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if abstract:
            return
        problems = []
        cfg = getattr(cls, "Config", None)
        if cfg is None or not (isinstance(cfg, type) and dataclasses.is_dataclass(cfg)):
            problems.append("it must define `Config`, a @dataclass(kw_only=True) of its options")
        if getattr(cls.forward, "__isabstractmethod__", False):
            problems.append("it must implement `forward(self, obs) -> PolicyOutput`")
        init = inspect.signature(cls.__init__)
        if "spec" not in init.parameters or "config" not in init.parameters:
            problems.append("its __init__ must accept `spec` (PolicySpec) and `config` (its Config)")
        if problems:
            raise TypeError(
                f"VLAPolicy subclass {cls.__qualname__} is incomplete: " + "; ".join(problems)
                + " (pass abstract=True in the class statement for an intermediate base)"
            )

    _API = ("forward", "prepare", "preprocess", "act", "evaluate", "value", "estimate_value", "optim_groups",
            "rollout_extras", "device", "imitation_loss", "model_inputs", "model_actions")

    def __setattr__(self, name: str, value: Any) -> None:
        # nn.Module keeps a submodule in ``_modules``, where attribute lookup never reaches a
        # name the class defines: ``self.act = nn.Linear(...)`` would leave ``self.act`` the
        # method and the layer unreachable. Say so where it happens.
        if name in self._API and isinstance(value, torch.nn.Module):
            raise TypeError(f"{type(self).__qualname__}: `self.{name} = <module>` would hide VLAPolicy.{name}; "
                            f"name the submodule otherwise (e.g. `self.{name}_head`)")
        super().__setattr__(name, value)

    def __init__(self, spec: PolicySpec, config: Any):
        super().__init__()
        self.spec = spec
        self.config = config
        self.cameras_used: tuple[str, ...] = ()
        """The further cameras (of ``spec.cameras``) this policy reads, in order: only these
        reach ``forward`` and are recorded and sent to the learner. None by default; a
        subclass that reads more sets it in ``__init__``."""
        self.tokenizer: Tokenizer = HashTokenizer()
        """Instruction strings -> ``(ids, mask)`` (:mod:`dvla.tokenizers`); replace it in a
        subclass's ``__init__`` (e.g. with an :class:`dvla.tokenizers.HFTokenizer`)."""
        self.temperature = 1.0
        """The sampling temperature of rollouts and of the learner's log-probs
        (``policy.temperature``, set by :func:`build_policy`): :meth:`act` samples from, and
        :meth:`evaluate` scores under, the head's distribution ``tempered`` by it. The most
        likely actions and the imitation loss do not depend on it."""

    # -- the one method a model must provide ---------------------------------------------
    @abstractmethod
    def forward(self, obs: Observation) -> PolicyOutput:
        """Map a batch with ``instruction_ids`` filled to an action distribution
        over chunks ``(B, K, D)`` and an optional value ``(B,)``."""

    # -- optional hooks --------------------------------------------------------------------
    def estimate_value(self, obs: Observation) -> Tensor | None:
        """A value estimate ``(B,)`` from a separate module, for a policy whose ``forward``
        returns none (``has_value_head = True`` still says PPO may use it). Called with the
        prepared observation, before ``forward``'s own value: when it gives one, that is the
        value, and :meth:`value` (the rollouts' bootstrap) runs no forward pass. None (the
        default): ``forward``'s value."""
        return None

    def _value(self, out: PolicyOutput, obs: Observation) -> Tensor | None:
        value = self.estimate_value(obs)
        return value if value is not None else out.value

    def optim_groups(self) -> list[dict] | None:
        """Parameter groups for the optimizer, as ``torch.optim`` takes them (e.g. a lower
        ``lr`` for a pretrained backbone, ``weight_decay`` 0 for norms and biases); keys a
        group leaves out take ``algo.lr`` and ``algo.weight_decay``. None (the default): one
        group of every trainable parameter. Frozen parameters (``requires_grad=False``) never
        reach the optimizer."""
        return None

    def shard_units(self) -> list[nn.Module]:
        """Submodules a sharded learner (``algo.shard=fsdp``) gathers one at a time, in
        forward order: a large model's transformer blocks, so that only one block's whole
        weights exist at once. Each must use its parameters only inside its own ``forward``.
        Default: none (the policy is one unit)."""
        return []

    def preprocess(self, obs: Observation) -> Observation:
        """Model-specific input preparation on the policy's device, right before ``forward``
        (rollout and learning alike): resize, normalise, crop each camera. The stored
        trajectories keep the env's raw uint8 images. Default: none."""
        return obs

    def imitation_loss(self, obs: Observation, actions: Tensor,
                       action_valid: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """The supervised loss of demonstrated chunks (``dvla sft``) and its stats to log:
        ``actions`` (B, K, D) as the dataset holds them (the env's space), ``action_valid``
        (B, K) false past an episode's end. Default: the head's
        :meth:`~dvla.distributions.ActionDistribution.imitation_loss` (the negative
        log-likelihood of the chunk for Gaussian, binned and token heads, conditional flow
        matching for the flow head) on the normalised observation and actions. A model
        overrides it for a loss of its own; :meth:`model_inputs` and :meth:`model_actions`
        give what the heads see."""
        out = self(self.model_inputs(obs))
        return out.dist.imitation_loss(self.model_actions(actions, clamp=True), action_valid)

    def rollout_extras(self) -> dict[str, ExtraSpec]:
        """What the head's :meth:`~dvla.distributions.ActionDistribution.draw` records beside
        each decision's actions (e.g. ``{"action_tokens": ExtraSpec((K * D,), torch.int64)}``).
        The rollout stores them per step, the data plane carries them with the chunk (the
        learner checks their shapes against this), and the learner passes them back to the
        distribution's ``log_prob_elements`` and ``entropy``. Default: none."""
        return {}

    # -- provided --------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _autocast(self):
        """Sampling with bf16 weights (an inference replica published in bf16,
        ``swimlane.publish_dtype``) runs under bf16 autocast, so fp32 inputs meet them."""
        p = next(self.parameters(), None)
        if p is None or p.dtype != torch.bfloat16:
            return contextlib.nullcontext()  # (cheaper than a disabled autocast: this runs every step)
        return torch.autocast(p.device.type, dtype=torch.bfloat16)

    def prepare(self, obs: Observation) -> Observation:
        """Tokenise instructions (once: ids and attention mask, the strings kept) and move the
        batch to the policy's device."""
        if obs.instruction_ids is None:
            if obs.instruction is None:
                raise ValueError("observation has neither instruction nor instruction_ids")
            ids, mask = tokenize(self.tokenizer, obs.instruction)
            obs = dataclasses.replace(obs, instruction_ids=ids, instruction_mask=mask)
        elif obs.instruction_mask is None:
            obs = dataclasses.replace(obs, instruction_mask=obs.instruction_ids != getattr(self.tokenizer, "pad_id", 0))
        if list(obs.cameras) != list(self.cameras_used):  # only those it reads, in its order
            missing = [c for c in self.cameras_used if c not in obs.cameras]
            if missing:
                raise ValueError(f"{type(self).__qualname__} reads cameras {missing}, which the observation lacks "
                                 f"(it has {sorted(obs.cameras)})")
            obs = dataclasses.replace(obs, cameras={c: obs.cameras[c] for c in self.cameras_used})
        return obs.to(self.device)

    def _sampling(self, dist):
        """The distribution rollouts sample from and the learner scores: ``dist`` at
        :attr:`temperature`."""
        return dist if self.temperature == 1.0 else dist.tempered(self.temperature)

    def model_inputs(self, obs: Observation) -> Observation:
        """What ``forward`` gets: ``obs`` prepared, its proprio normalised (:attr:`normalizer`)
        and preprocessed."""
        obs = self.prepare(obs)
        if self.normalizer is not None:
            obs = dataclasses.replace(obs, proprio=self.normalizer.proprio(obs.proprio))
        return self.preprocess(obs)

    def model_actions(self, actions: Tensor, clamp: bool = False) -> Tensor:
        """Env actions -> the heads' space (:attr:`normalizer`; ``clamp``: into [-1, 1], for
        demonstrations beyond the normalisation's quantile bounds)."""
        if self.normalizer is None:
            return actions
        actions = self.normalizer.actions(actions.to(self.device))
        return actions.clamp(-1.0, 1.0) if clamp else actions

    @torch.no_grad()
    def act(
        self,
        obs: Observation,
        deterministic: bool = False,
        generator: torch.Generator | None = None,
    ) -> ActOutput:
        """Choose action chunks for a batch (rollout path): actions, their log-probs
        under this policy and value estimates (the actions in the env's space: see
        :attr:`normalizer`)."""
        obs = self.model_inputs(obs)
        with self._autocast():
            out = self(obs)
            draw = self._sampling(out.dist).draw(deterministic, generator)
            values = self._value(out, obs)
        if values is None:
            values = torch.zeros(draw.actions.shape[0], device=draw.actions.device)
        want = self.rollout_extras()
        if draw.extras.keys() != want.keys():
            raise RuntimeError(f"{type(self).__qualname__}: the head drew extras {sorted(draw.extras)}, "
                               f"rollout_extras() declares {sorted(want)}")
        actions = draw.actions if self.normalizer is None else self.normalizer.unactions(draw.actions)
        return ActOutput(actions=actions, log_probs=draw.log_prob, values=values,
                         log_prob_elements=draw.elements, extras=draw.extras)

    def evaluate(self, obs: Observation, actions: Tensor, action_valid: Tensor | None = None,
                 ratio: str = "joint", extras: dict[str, Tensor] | None = None) -> EvalOutput:
        """Log-probs and entropy of given actions, with gradients (learning path).
        ``action_valid`` (B, K) leaves out the actions of a chunk the env did not apply (the
        episode had ended); ``ratio`` is the granularity of the log-probs: ``joint`` (B,),
        ``step`` (B, K) or ``dim`` (B, K, D) (see :func:`chunk_log_probs`); ``extras``: what
        the rollout recorded beside the actions (:meth:`rollout_extras`)."""
        obs = self.model_inputs(obs)
        out = self(obs)
        dist = self._sampling(out.dist)
        actions = self.model_actions(actions)
        return EvalOutput(log_probs=chunk_log_probs(dist, actions, action_valid, ratio, extras),
                          entropy=dist.entropy(extras), values=self._value(out, obs))

    @torch.no_grad()
    def value(self, obs: Observation) -> Tensor:
        """Value estimates ``(B,)`` (zeros without a value head): :meth:`estimate_value`'s
        where it gives them (no forward pass), else ``forward``'s."""
        obs = self.model_inputs(obs)
        with self._autocast():
            value = self.estimate_value(obs)
            if value is None:
                value = self(obs).value
        return value if value is not None else torch.zeros(obs.batch_size, device=self.device)


def chunk_log_probs(dist, actions: Tensor, action_valid: Tensor | None, ratio: str = "joint",
                    extras: dict[str, Tensor] | None = None) -> Tensor:
    """Log-probs of ``actions`` (drawn with ``extras``) under ``dist`` at the granularity of
    ``algo.ratio``: the whole chunk (``joint``, (B,)), each chunk step (``step``, (B, K)) or
    each action dimension (``dim``, (B, K, D)); actions with ``action_valid`` false count for
    nothing."""
    elements = dist.log_prob_elements(actions, extras)
    if elements is None:
        if ratio != "joint":
            raise ValueError(f"algo.ratio={ratio} needs per-dimension log-probs, and "
                             f"{type(dist).__name__} has no log_prob_elements: use algo.ratio=joint")
        return dist.log_prob(actions, extras)
    if action_valid is not None:
        elements = elements * action_valid.unsqueeze(-1).to(elements.dtype)
    if ratio == "joint":
        return elements.sum(dim=(1, 2))
    return elements.sum(dim=2) if ratio == "step" else elements


POLICY_REGISTRY: dict[str, type[VLAPolicy]] = {}


def register_policy(name: str) -> Callable[[type[VLAPolicy]], type[VLAPolicy]]:
    """Class decorator adding a :class:`VLAPolicy` subclass to the registry under ``name``."""

    def deco(cls: type[VLAPolicy]) -> type[VLAPolicy]:
        if not (isinstance(cls, type) and issubclass(cls, VLAPolicy)):
            raise TypeError(f"@register_policy({name!r}) must decorate a VLAPolicy subclass, got {cls!r}")
        if name in POLICY_REGISTRY and POLICY_REGISTRY[name] is not cls:
            other = POLICY_REGISTRY[name]
            raise ValueError(
                f"policy name {name!r} is already registered by {other.__module__}.{other.__qualname__}"
            )
        POLICY_REGISTRY[name] = cls
        cls.registry_name = name
        return cls

    return deco


def policy_config(name: str, options: dict[str, Any] | None = None) -> Any:
    """The registered policy ``name``'s ``Config`` built from ``options`` and validated,
    without building the model: a :class:`ConfigError` names an unknown policy (and the
    registered ones) or an unknown or invalid option (and the allowed ones)."""
    if name not in POLICY_REGISTRY:
        raise ConfigError(
            f"policy.name: unknown policy {name!r}; registered: {', '.join(sorted(POLICY_REGISTRY))}"
        )
    cls = POLICY_REGISTRY[name]
    if not isinstance(options or {}, dict):
        raise ConfigError(f"policy.options: expected a mapping, got {options!r}")
    cfg = from_dict(cls.Config, dict(options or {}), path="policy.options.")
    validate(cfg, path="policy.options.")
    return cfg


def build_policy(name: str, spec: PolicySpec, options: dict[str, Any] | None = None,
                 temperature: float = 1.0) -> VLAPolicy:
    """Instantiate the registered policy ``name`` with ``options`` checked against its Config,
    sampling at ``temperature`` (:attr:`VLAPolicy.temperature`)."""
    cfg = policy_config(name, options)
    policy = POLICY_REGISTRY[name](spec=spec, config=cfg)
    policy.temperature = float(temperature)
    return policy
