"""Adapter that runs any ``gymnasium`` vector env behind the :class:`BatchedEnv` interface.

Options (``env.options``):

* ``gym_id`` (required): the id given to ``gymnasium.make_vec``.
* ``instruction``: the language instruction attached to every observation
  (default: ``"solve <gym_id>"``).
* ``image_key``: for ``Dict`` observation spaces, the key of an ``(H, W, 3)`` image;
  the remaining keys are flattened into proprio. Without it the image is all zeros
  (these envs have no camera unless one is configured), labelled so in the docs.
* ``make_kwargs``: extra keyword arguments for ``gymnasium.make_vec``.

Actions in [-1, 1] are rescaled to a ``Box`` space's bounds; for ``Discrete(n)`` the
single action dimension is cut into ``n`` equal intervals. Success is read from
``info["is_success"]`` or ``info["success"]`` when the env reports it.
Group members of a GRPO group are reset with the same seed, so they start identically.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dvla.config import ConfigError, EnvConfig
from dvla.envs.base import BatchedEnv, EnvSpec
from dvla.envs.options import Option
from dvla.types import Observation


class GymVectorEnv(BatchedEnv):
    OPTIONS = {
        "gym_id": Option(None, "the gymnasium env id, or module:EnvId (the module registers it); required",
                         kind="str", none=True),
        "instruction": Option(None, "the instruction of every observation (null: 'solve <gym_id>')", kind="str",
                              none=True),
        "image_key": Option(None, "for a Dict observation space, the key of its (H, W, 3) image (null: none)",
                            kind="str", none=True),
        "make_kwargs": Option({}, "keyword arguments of gymnasium.make_vec", kind="mapping"),
    }

    @classmethod
    def check_config(cls, cfg: EnvConfig) -> dict:
        """``cfg.options`` over the defaults, checked without building an env: known keys,
        ``gym_id`` given and registered with gymnasium (ConfigError)."""
        opts = cls.options_of(cfg, cls.OPTIONS)
        gym_id = opts["gym_id"]
        if not gym_id or not isinstance(gym_id, str):
            raise ConfigError("env.options.gym_id: required for env.name='gym' (e.g. env.options.gym_id=Pendulum-v1)")
        try:
            import gymnasium as gym
        except ImportError:
            raise ConfigError("env.name: 'gym' needs the gymnasium package (pip install gymnasium)") from None
        name = gym_id
        if ":" in gym_id:  # "module:EnvId": the module registers the env when imported
            import importlib

            module, name = gym_id.split(":", 1)
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ConfigError(f"env.options.gym_id: cannot import {module!r} for {gym_id!r}: {exc}") from None
        try:
            gym.spec(name)
        except gym.error.Error as exc:
            raise ConfigError(f"env.options.gym_id: {exc}") from None
        return opts

    def __init__(self, cfg: EnvConfig, device: torch.device | str = "cpu", seed: int = 0, vec_env=None):
        super().__init__(cfg, device, seed)
        import gymnasium as gym

        opts = self._options(self.OPTIONS)
        gym_id = opts["gym_id"]
        if vec_env is None:
            if not gym_id:
                raise ConfigError("env.options.gym_id: required for env.name='gym' (e.g. 'Pendulum-v1')")
            try:
                vec_env = gym.make_vec(
                    gym_id, num_envs=cfg.n_envs, vectorization_mode="sync",
                    **opts["make_kwargs"],
                )
            except gym.error.Error as exc:
                raise ConfigError(f"env.options.gym_id: cannot make {gym_id!r}: {exc}") from exc
        if vec_env.num_envs != cfg.n_envs:
            raise ConfigError(f"env.n_envs={cfg.n_envs} but the vector env has {vec_env.num_envs} envs")
        self.vec = vec_env
        self.instruction = opts["instruction"] or f"solve {gym_id or 'task'}"
        self.image_key = opts["image_key"]
        self._seed = seed
        self._episode = 0

        space = vec_env.single_observation_space
        if isinstance(space, gym.spaces.Dict):
            keys = [k for k in space.spaces if k != self.image_key]
            self._proprio_keys = keys
            pdim = sum(int(np.prod(space.spaces[k].shape)) for k in keys)
            if self.image_key is not None:
                if self.image_key not in space.spaces:
                    raise ConfigError(f"env.options.image_key: {self.image_key!r} not in {list(space.spaces)}")
                h, w, c = space.spaces[self.image_key].shape
                image_shape = (c, h, w)
            else:
                image_shape = (3, cfg.image_size, cfg.image_size)
        else:
            if self.image_key is not None:
                raise ConfigError("env.options.image_key: needs a Dict observation space")
            self._proprio_keys = None
            pdim = int(np.prod(space.shape))
            image_shape = (3, cfg.image_size, cfg.image_size)

        act = vec_env.single_action_space
        if isinstance(act, gym.spaces.Discrete):
            self._discrete = int(act.n)
            adim = 1
        elif isinstance(act, gym.spaces.Box):
            self._discrete = 0
            adim = int(np.prod(act.shape))
            self._low = np.broadcast_to(act.low, act.shape).reshape(-1).astype(np.float32)
            self._half_range = (np.broadcast_to(act.high, act.shape).reshape(-1).astype(np.float32) - self._low) * 0.5
            self._act_shape = act.shape
        else:
            raise ConfigError(f"env.options.gym_id: unsupported action space {act}")
        self.spec = EnvSpec(image_shape=image_shape, proprio_dim=pdim, action_dim=adim)
        self._last_obs = None

    def _reset(self, group_size: int) -> None:
        base = self._seed * 1_000_003 + self._episode * self.n_envs
        seeds = [base + i // group_size for i in range(self.n_envs)]
        self._episode += 1
        obs, _ = self.vec.reset(seed=seeds)
        self._last_obs = obs

    def _reset_envs(self, envs: Tensor, group_size: int) -> None:
        base = self._seed * 1_000_003 + self._episode * self.n_envs
        self._episode += 1
        seeds: list[int | None] = [None] * self.n_envs
        mask = np.zeros(self.n_envs, dtype=bool)
        for j, i in enumerate(envs.tolist()):
            seeds[i], mask[i] = base + j // group_size, True
        obs, _ = self.vec.reset(seed=seeds, options={"reset_mask": mask})
        self._last_obs = obs

    def _step_action(self, action: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # numpy on the host: a few small tensor ops would cost more than a cheap task's step
        a = action.detach().to("cpu", torch.float32).numpy()
        if self._discrete:
            act = np.clip(((a[:, 0] + 1.0) * 0.5 * self._discrete).astype(np.int64), 0, self._discrete - 1)
        else:
            act = (self._low + (a + 1.0) * self._half_range).reshape(self.n_envs, *self._act_shape)
        obs, reward, term, trunc, info = self.vec.step(act)
        self._last_obs = obs
        success = None
        for key in ("is_success", "success"):
            if key in info:
                success = np.asarray(info[key], dtype=bool)
                break
        dev = self.device

        def tensor(x, dtype):  # a fresh array (the vector env may reuse its own) as a tensor
            return torch.from_numpy(np.array(x, dtype=dtype)).to(dev)

        return (tensor(reward, np.float32), tensor(term, bool), tensor(trunc, bool),
                tensor(success, bool) if success is not None else torch.zeros(self.n_envs, dtype=torch.bool, device=dev))

    def _observe(self) -> Observation:
        obs = self._last_obs
        if self._proprio_keys is not None:
            parts = [np.asarray(obs[k], dtype=np.float32).reshape(self.n_envs, -1) for k in self._proprio_keys]
            proprio = np.concatenate(parts, axis=1) if parts else np.zeros((self.n_envs, 0), np.float32)
        else:
            proprio = np.asarray(obs, dtype=np.float32).reshape(self.n_envs, -1)
        if self.image_key is not None:
            image = torch.as_tensor(np.ascontiguousarray(obs[self.image_key])).permute(0, 3, 1, 2)
        else:
            image = torch.zeros(self.n_envs, *self.spec.image_shape, dtype=torch.uint8)
        return Observation(
            image=image.to(self.device, torch.uint8),
            proprio=torch.as_tensor(proprio, device=self.device),
            instruction=[self.instruction] * self.n_envs,
        )

    def close(self) -> None:
        self.vec.close()
