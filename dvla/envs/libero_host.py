"""LIBERO's own side of :class:`dvla.envs.libero_env.LiberoEnv`: a suite's tasks, a host that
builds and steps LIBERO envs (in this process or a spawned worker process), and the calls
between the two. Imports LIBERO on use only (extra ``[libero]``)."""

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

from dvla.config import ConfigError
from dvla.envs.base import seeded_numpy
from dvla.envs.egl_devices import choose_render_device

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


class _FreshReset:
    """Resets one LIBERO env to the start a freshly built env has: robosuite's soft reset
    (``env.reset()`` with ``hard_reset=False``: the model is not reloaded), then what that
    reset keeps put back as the env was built.

    What the soft reset resets itself: MuJoCo's data (``mj_resetData``: positions,
    velocities, controls, warm start, time), the robot (a new controller, so new goals; new
    ``recent_*`` buffers; the arm's and gripper's joints), the env's ``timestep``, ``done`` and
    observation cache, every observable's sampling clock, and the placement of objects and
    fixtures (drawn anew from numpy's global generator; fixtures live in the model, so their
    pose is the reset's draw, not the initial state's). What it keeps: each gripper's smoothed
    command (``current_action``, which moves by ``speed`` towards the commanded side in every
    simulation step): after an episode that closed the gripper, the next one would start its
    settle steps from a closed command. Compared field by field with a freshly built env (its
    MuJoCo data and model, and the Python state of the env, robots, controllers, grippers and
    observables) after this reset, nothing else differs. A hard reset (a model reload: 2.0 s
    against 0.28 s for one env with a 64 px camera on 2 cores, ``bench/libero_env.py
    --reset-cost``) gives the same first observation, bitwise.
    """

    def __init__(self, env):
        self.env = env
        self.built = [(g, np.array(g.current_action, copy=True)) for g in self._grippers(env)]

    @staticmethod
    def _grippers(env) -> list:
        out = []
        for robot in getattr(env.env, "robots", ()):
            gripper = robot.gripper
            out += list(gripper.values()) if isinstance(gripper, dict) else [gripper]  # (a bimanual robot: two)
        return out

    def __call__(self) -> None:
        self.env.reset()
        for gripper, command in self.built:
            gripper.current_action = command.copy()


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


def _solid_geoms(inner) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every colliding geom of each object and fixture (bodies below its root included) as an
    oriented box around it: centres (G, 3), rotations (G, 3, 3), half sizes (G, 3), world frame."""
    m, d = inner.sim.model._model, inner.sim.data._data
    roots = {i: name for name, i in inner.obj_body_id.items()}
    boxes: dict[str, list] = {}
    for g in range(m.ngeom):
        b = int(m.geom_bodyid[g])
        while b and b not in roots:
            b = int(m.body_parentid[b])
        if b not in roots or not (m.geom_contype[g] or m.geom_conaffinity[g]):
            continue
        rot = d.geom_xmat[g].reshape(3, 3)
        boxes.setdefault(roots[b], []).append((d.geom_xpos[g] + rot @ m.geom_aabb[g, :3], rot, m.geom_aabb[g, 3:]))
    return {name: tuple(np.array(x) for x in zip(*v)) for name, v in boxes.items()}


class _LazyCamera:
    """A robosuite camera sensor that renders only while ``live`` and otherwise hands back its
    last frame: robosuite samples every camera in every step (at one fixed simulation substep),
    but inside a chunk no policy reads the frames. A live step renders at the very substep
    robosuite's own sampling does, so the frames are the ones LIBERO's own stepping gives."""

    def __init__(self, sensor):
        self.sensor, self.live, self.frame = sensor, True, None
        self.__modality__ = sensor.__modality__  # robosuite reads a sensor's modality from it

    def __call__(self, obs_cache):
        if self.live or self.frame is None:
            self.frame = self.sensor(obs_cache)
        return self.frame

    @classmethod
    def install(cls, env, name: str) -> "_LazyCamera":
        camera = cls(env._observables[name]._sensor)
        env.modify_observable(name, "sensor", camera)
        return camera


class LiberoHost:
    """Some of the envs, stepped one after the other in one process (this one or a worker's).
    Every method returns plain numpy arrays, one row per env it holds."""

    def __init__(self, suite: str, task_ids: list[int], image_size: int, wrist_size: int, render: bool,
                 settle_steps: int, seed: int, render_gpu: int = -1, render_pci: str | None = None,
                 render_gpus: int | None = None, sampled: bool = False):
        """``seed``: the env's (the same in every host of it), which with the task and the
        initial state fixes an episode's draws (:meth:`draw_seed`). ``render_gpu``: the CUDA
        ordinal of the rank's GPU (-1: render on the CPU), its PCI address ``render_pci`` and
        the number of CUDA devices the rank sees, ``render_gpus``: the EGL device is the one
        that matches them (:mod:`dvla.envs.egl_devices`)."""
        _, _, ControlEnv, OffScreenRenderEnv = _import_libero()
        if render and render_gpu >= 0:  # after the import: robosuite's asserts on MUJOCO_EGL_DEVICE_ID
            render_gpu = choose_render_device(render_pci, render_gpu, render_gpus)
        self.tasks = LiberoTasks(suite)
        self.task_ids = task_ids
        self.image_size, self.wrist_size, self.render = image_size, wrist_size, render
        self.settle_steps, self.sampled, self.seed = settle_steps, sampled, int(seed)
        self._states = {t: self.tasks.init_states(t) for t in set(task_ids)}
        self.envs = []
        names, sizes = (["agentview", "robot0_eye_in_hand"], [image_size, wrist_size]) if wrist_size else \
            (["agentview"], [image_size])
        with seeded_numpy(self.seed):  # (building draws too; the process's generator is left as it was)
            for t in task_ids:
                kw = dict(bddl_file_name=self.tasks.bddl(t), hard_reset=False, ignore_done=True)
                if render:
                    env = OffScreenRenderEnv(camera_names=names, camera_heights=sizes, camera_widths=sizes,
                                             render_gpu_device_id=render_gpu, **kw)
                else:
                    env = ControlEnv(has_renderer=False, has_offscreen_renderer=False, use_camera_obs=False, **kw)
                env.reset()
                self.envs.append(env)
        self._fresh = [_FreshReset(env) for env in self.envs]
        self._obs = [None] * len(self.envs)
        self._cameras = [[_LazyCamera.install(env.env, f"{n}_image") for n in names] if render else []
                         for env in self.envs]
        self._settle = np.zeros(ACTION_DIM)
        self._settle[-1] = -1.0  # gripper open

    def reset(self, items: list[tuple[int, int]]) -> dict[str, np.ndarray]:
        """Restart env ``j`` from initial state ``k`` of its task, for each ``(j, k)`` (``sampled``:
        from the new initial state that seed ``k`` draws), as a freshly built env starts it: a
        function of the task, ``k`` and the env's seed alone (:meth:`draw_seed`), whatever the
        env ran before, whichever env or process runs it."""
        for j, k in items:
            env = self.envs[j]
            self._render(j, self.settle_steps == 0)
            with seeded_numpy(self.draw_seed(self.task_ids[j], k)):
                self._fresh[j]()  # (sampled: its reset draws the state)
            state = env.get_sim_state() if self.sampled else self._states[self.task_ids[j]][k]
            obs = env.set_init_state(state)
            for i in range(self.settle_steps):
                self._render(j, i == self.settle_steps - 1)
                obs, _, _, _ = env.step(self._settle)
            self._obs[j] = obs
        return self.observe()

    def draw_seed(self, task: int, k: int):
        """What numpy's global generator is seeded with for the reset before an episode of
        ``task`` from initial state ``k`` (LIBERO's ``env.seed`` takes it too). The reset draws
        the fixtures' placement (and, where the initial state does not override them, the
        objects' and the robot's joint noise). Sampled states: ``k`` is the state's own seed,
        and the reset's draws are the state (objects and robot from the task's regions and
        noise, fixtures too), the same for the same task and ``k`` in any process. Fixed
        states: ``[seed, task, k]``: the env's seed, the task and the state's index."""
        if self.sampled:
            return (int(k) * 1000003 + task) % 2**32
        return [self.seed % 2**32, int(task), int(k)]

    def step(self, actions: np.ndarray, observe: bool = True, live: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One action ``(n, 7)`` in each env; the observation and whether the task's goal holds
        (LIBERO's own reward is that, 0 or 1; the env pays ``success_reward`` for it). With
        ``observe=False`` (an action inside a chunk, whose observation no policy reads) the
        cameras render nothing and the frames returned are the last observed step's. Envs
        not ``live`` (their episode ended; the batch waits for the others) do not step."""
        success = np.zeros(len(self.envs), bool)
        for j, env in enumerate(self.envs):
            if live is not None and not live[j]:
                continue
            self._render(j, observe)
            self._obs[j], _, _, _ = env.step(actions[j])
            success[j] = bool(env.check_success())
        return {**self.observe(), "success": success}

    def _render(self, j: int, on: bool) -> None:
        """Whether env ``j``'s cameras render in its next step (or reset)."""
        for camera in self._cameras[j]:
            camera.live = on

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

    def privileged(self, geoms: bool = False) -> dict:
        """The simulator's state a scripted expert acts on (no policy sees it), per env: the
        effector's position, orientation (quaternion x, y, z, w) and finger positions, as in
        the last observation, the task's goal predicates (from its BDDL file) and the
        position and orientation (x, y, z, w) of every object and fixture (body origins,
        world frame); with ``geoms`` also their shapes (:func:`_solid_geoms`)."""
        out = {"eef_pos": [], "eef_quat": [], "gripper_qpos": [], "goal": [], "objects": [], "quats": []}
        if geoms:
            out["geoms"] = [_solid_geoms(env.env) for env in self.envs]
        for env, o in zip(self.envs, self._obs):
            if o is None:
                raise RuntimeError("libero host: privileged() before the env's first reset")
            inner = env.env
            out["eef_pos"].append(o["robot0_eef_pos"])
            out["eef_quat"].append(o["robot0_eef_quat"])
            out["gripper_qpos"].append(o["robot0_gripper_qpos"])
            out["goal"].append([list(p) for p in inner.parsed_problem["goal_state"]])
            xpos, xquat = inner.sim.data.body_xpos, inner.sim.data.body_xquat
            out["objects"].append({name: xpos[i].copy() for name, i in inner.obj_body_id.items()})
            out["quats"].append({name: xquat[i][[1, 2, 3, 0]] for name, i in inner.obj_body_id.items()})
        for key in ("eef_pos", "eef_quat", "gripper_qpos"):
            out[key] = np.asarray(out[key], np.float64).reshape(len(self.envs), -1)
        return out

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
