"""Franka Panda tasks in genesis-world: ``genesis_reach`` and ``genesis_lift``.

Scene: ground plane, a Franka Panda (``xml/franka_emika_panda/panda.xml``, shipped with
genesis), and a task object (a red target sphere that does not collide, or a red
cube). ``n_envs`` copies are simulated as one batch.

Action (D=4, in [-1, 1]): the commanded fingertip position and the gripper command (> 0
closes), with the gripper pointing down, solved with batched inverse kinematics. With
``options.action_mode="delta"`` (the default) the first three move the commanded position
by up to ``options.max_delta`` metres per control step (OpenVLA-style end-effector
deltas); with ``"target"`` they name the commanded position itself, scaled to the box
``TARGET_LO``-``TARGET_HI`` above the table (a position-target controller: one decision
says where to go, and the arm gets there over the next control steps).
Proprio: 9 joint positions, the fingertip position and the commanded fingertip position
(15; actions move the commanded position, which the arm follows with some lag, so a
policy must see it to act without overshooting), plus the goal with
``options.privileged=true`` (18). Positions are in workspace units: 0 at the centre of the
``TARGET_LO``-``TARGET_HI`` box and +-1 at its faces (metres would give a network inputs
that vary by a few hundredths, which it learns from slowly), the same scale as
``action_mode="target"``'s actions.
Camera: one RGB camera per env (``VisOptions(split_envs=True)``), rendered on the CPU
through EGL (``PYOPENGL_PLATFORM=egl`` is set when there is no ``DISPLAY``); rendering
costs far more than physics (bench/RESULTS.md), which is exactly the load the
swimlane overlaps with model work. ``render=false`` skips the camera.

The camera draws the robot's collision geometry (``options.vis_mode="collision"``, the
default): on a software rasteriser its detailed visual meshes cost about nine times as
much per image (``bench/genesis_render.py``: 2 against 19 ms per 64-pixel image on two
cores), and the coarse shapes show the arm just as well to a 64-pixel camera. ``vis_mode="visual"`` draws the visual meshes.
genesis colours the collision shapes at random, from numpy's global generator; the scene is
built with it seeded (``seeded_numpy(0)``), so that every scene, in every process and run,
looks the same.

A reset (of all envs, or of some on their own clock) starts each env as a freshly built scene
starts it, for the same goal draws: the arm at home at rest, the object at rest in its place,
the other envs untouched; and the first frame shows the new episode (rendered forced: genesis
updates what it draws once per simulation step, and a reset takes none).

genesis compiles its kernels on the first ``scene.build`` (1-2 minutes, cached under
``$XDG_CACHE_HOME/quadrants``; later builds ~8 s); a line says so before the first build
of a process. The cache key includes the ``gs.init`` seed and ``QD_NUM_THREADS``, so we
never pass the job seed to ``gs.init`` (randomness comes from torch generators) and leave
``QD_NUM_THREADS`` alone. genesis' warnings about the shipped Franka model repeat at every
scene build; they are shown once each, and only with ``--verbose`` (``DVLA_VERBOSE=1``).
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import torch
from torch import Tensor

from dvla.config import EnvConfig
from dvla.envs.base import EnvSpec, GoalEnv, seeded_numpy
from dvla.envs.genesis_import import import_genesis
from dvla.envs.options import Option
from dvla.types import Observation

HOME_Q = (0.0, -0.785, 0.0, -2.356, 0.0, 1.571, 0.785, 0.04, 0.04)
KP = (4500, 4500, 3500, 3500, 2000, 2000, 2000, 100, 100)
KV = (450, 450, 350, 350, 200, 200, 200, 10, 10)
DOWN_QUAT = (0.0, 1.0, 0.0, 0.0)  # wxyz: gripper pointing at the table
TIP_OFFSET = 0.105  # metres from the hand link origin down to the fingertip centre

log = logging.getLogger("dvla.envs.genesis")
_init_lock = threading.Lock()
_backend: str | None = None
_built_once = False


class _OncePerMessage(logging.Filter):
    """Pass each distinct genesis message once per process."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if msg in self.seen:
            return False
        self.seen.add(msg)
        return True


def kernel_cache_dir() -> str:
    """Where quadrants (genesis' kernel compiler) caches compiled kernels."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "quadrants")


def announce_build() -> None:
    """One line before this process's first scene build: a cold kernel cache means minutes
    of silence otherwise."""
    global _built_once
    with _init_lock:
        if _built_once:
            return
        _built_once = True
    cache = kernel_cache_dir()
    if os.path.isdir(cache) and any(os.scandir(cache)):
        log.info("building the genesis scene (simulator kernels cached in %s)", cache)
    else:
        log.warning("compiling simulator kernels, first run only: 1-2 minutes on 2 cores "
                    "(cached in %s for later runs)", cache)


def ensure_genesis(device: torch.device) -> None:
    """Initialise genesis once per process, on the backend matching ``device``."""
    global _backend
    want = "gpu" if device.type == "cuda" else "cpu"
    if not os.environ.get("DISPLAY"):
        os.environ.setdefault("PYOPENGL_PLATFORM", "egl")  # headless camera rendering
    gs = import_genesis()

    with _init_lock:
        if _backend is None:
            verbose = os.environ.get("DVLA_VERBOSE", "") not in ("", "0")
            gs.init(
                backend=gs.gpu if want == "gpu" else gs.cpu,
                logging_level="warning" if verbose else "error",
                precision="32",
                performance_mode=False,
            )
            logging.getLogger("genesis").addFilter(_OncePerMessage())
            _backend = want
        elif _backend != want:
            raise RuntimeError(
                f"genesis is already initialised on {_backend} in this process; cannot use {want}"
            )


class GenesisFrankaEnv(GoalEnv):
    """Common scene and control for the Franka tasks."""

    VIS_MODES = ("collision", "visual")
    ACTION_MODES = ("delta", "target")
    OPTIONS = {
        "max_delta": Option(0.08, "metres the commanded fingertip moves per control step at full action (delta)",
                            gt=0, le=0.5),
        "substeps_per_action": Option(8, "physics steps per control step", kind="int", ge=1, le=100),
        "dt": Option(0.01, "seconds per physics step", gt=0, le=0.1),
        "privileged": Option(False, "proprio carries the goal position too", kind="bool"),
        "vis_mode": Option("collision", "the geometry the camera draws", kind="str", choices=VIS_MODES),
        "action_mode": Option("delta", "actions move the commanded position (delta) or name it (target)",
                              kind="str", choices=ACTION_MODES),
    }
    WORKSPACE_LO, WORKSPACE_HI = (0.25, -0.45, 0.005), (0.85, 0.45, 0.6)  # commanded positions are clamped here
    TARGET_LO, TARGET_HI = (0.3, -0.3, 0.05), (0.75, 0.3, 0.45)  # action_mode=target maps [-1, 1] here
    task_object = "sphere"

    @classmethod
    def spec_for(cls, cfg: EnvConfig) -> EnvSpec:
        """Joint positions (9), fingertip position (3), commanded fingertip position (3), and
        the goal (3) when privileged; end-effector deltas (3) and a gripper command (1)."""
        privileged = bool(cls.options_of(cfg, cls.OPTIONS)["privileged"])
        s = cfg.image_size
        return EnvSpec(image_shape=(3, s, s), proprio_dim=15 + (3 if privileged else 0), action_dim=4)

    @classmethod
    def check_config(cls, cfg: EnvConfig) -> dict:
        """``cfg.options`` over the defaults, checked without building a scene (ConfigError)."""
        return cls.options_of(cfg, cls.OPTIONS)

    def __init__(self, cfg: EnvConfig, device: torch.device | str = "cpu", seed: int = 0):
        super().__init__(cfg, device, seed)
        opts = self.check_config(cfg)
        self.max_delta = float(opts["max_delta"])
        self.substeps = int(opts["substeps_per_action"])
        self.privileged = bool(opts["privileged"])
        self.action_mode = opts["action_mode"]
        ensure_genesis(self.device)
        with seeded_numpy(0):  # genesis colours collision shapes at random: every scene alike
            self._build_scene(cfg, opts)
        self.hand = self.robot.get_link("hand")
        self.robot.set_dofs_kp(torch.tensor(KP, dtype=torch.float32))
        self.robot.set_dofs_kv(torch.tensor(KV, dtype=torch.float32))
        self._home = torch.tensor(HOME_Q, dtype=torch.float32, device=self.device)
        self._down = torch.tensor(DOWN_QUAT, dtype=torch.float32, device=self.device).repeat(self.n_envs, 1)
        self._tip = torch.tensor([0.0, 0.0, TIP_OFFSET], device=self.device)
        self.spec = self.spec_for(cfg)
        self.goal = torch.zeros(self.n_envs, 3, device=self.device)
        self.ee_target = torch.zeros(self.n_envs, 3, device=self.device)
        self._gripper = torch.full((self.n_envs,), 0.04, device=self.device)

    def _build_scene(self, cfg: EnvConfig, opts: dict) -> None:
        """The scene: ground, the arm, the task's object and the camera, built for ``n_envs``."""
        import genesis as gs

        vis = gs.options.VisOptions(split_envs=True, shadow=False)
        self.scene = gs.Scene(
            sim_options=gs.options.SimOptions(dt=float(opts["dt"]), substeps=2),
            vis_options=vis,
            show_viewer=False,
        )
        self.scene.add_entity(gs.morphs.Plane())
        self.robot = self.scene.add_entity(gs.morphs.MJCF(file="xml/franka_emika_panda/panda.xml"),
                                           vis_mode=opts["vis_mode"])
        red = gs.surfaces.Default(color=(0.9, 0.1, 0.1))
        if self.task_object == "sphere":
            self.obj = self.scene.add_entity(
                gs.morphs.Sphere(radius=0.03, pos=(0.55, 0.0, 0.3), fixed=True, collision=False), surface=red
            )
        else:
            self.obj = self.scene.add_entity(
                gs.morphs.Box(size=(0.04, 0.04, 0.04), pos=(0.6, 0.0, 0.02)), surface=red
            )
        s = cfg.image_size
        self.camera = None
        if cfg.render:
            self.camera = self.scene.add_camera(
                res=(s, s), pos=(1.25, 0.0, 0.75), lookat=(0.45, 0.0, 0.15), fov=45, GUI=False
            )
        announce_build()
        self.scene.build(n_envs=self.n_envs)

    # -- task-specific ------------------------------------------------------------------
    def _sample_goal(self, g: int) -> Tensor:
        raise NotImplementedError

    def _place_object(self, envs: Tensor) -> None:
        """Put the task's object at the goal in the envs ``envs``, at rest (the others untouched)."""
        raise NotImplementedError

    # -- GoalEnv hooks ----------------------------------------------------------------------
    def _reset_task(self, group_size: int) -> None:
        self._reset_task_envs(torch.arange(self.n_envs, device=self.device), group_size)

    def _reset_task_envs(self, envs: Tensor, group_size: int) -> None:
        """The envs ``envs`` at the start a freshly built scene gives, the others untouched: the
        arm at home at rest, its position targets home, the object placed at rest, a new goal.
        Nothing else carries over: genesis clears the contact and constraint solvers' warm
        starts of the envs whose state is set, and the inverse kinematics starts from the arm's
        position (its restarts are seeded, the same every call)."""
        self.goal[envs] = self.group_repeat(self._sample_goal(len(envs) // group_size), group_size).to(self.device)
        q = self._home.repeat(len(envs), 1)
        self.robot.set_dofs_position(q, envs_idx=envs, zero_velocity=True)
        self.robot.control_dofs_position(q, envs_idx=envs)
        self._place_object(envs)
        self.ee_target[envs] = self.tip_pos()[envs]
        self._gripper[envs] = 0.04

    def _apply(self, action: Tensor) -> None:
        lo = torch.tensor(self.WORKSPACE_LO, device=self.device)
        hi = torch.tensor(self.WORKSPACE_HI, device=self.device)
        if self.action_mode == "target":
            t_lo = torch.tensor(self.TARGET_LO, device=self.device)
            t_hi = torch.tensor(self.TARGET_HI, device=self.device)
            target = t_lo + (action[:, :3] + 1.0) * 0.5 * (t_hi - t_lo)
        else:
            target = self.ee_target + self.max_delta * action[:, :3]
        self.ee_target = torch.maximum(torch.minimum(target, hi), lo)
        hand_target = self.ee_target + self._tip
        q = self.robot.inverse_kinematics(link=self.hand, pos=hand_target, quat=self._down)
        q = q.to(self.device).clone()
        self._gripper = torch.where(action[:, 3] > 0, 0.0, 0.04)
        q[:, 7:] = self._gripper.unsqueeze(-1)
        self.robot.control_dofs_position(q)
        for _ in range(self.substeps):
            self.scene.step()

    def workspace_units(self, pos: Tensor) -> Tensor:
        """Positions in metres -> 0 at the target box's centre, +-1 at its faces."""
        lo = torch.tensor(self.TARGET_LO, device=pos.device)
        hi = torch.tensor(self.TARGET_HI, device=pos.device)
        return (pos - (lo + hi) * 0.5) / ((hi - lo) * 0.5)

    def tip_pos(self) -> Tensor:
        """Fingertip centre ``(B, 3)``, assuming the gripper points down."""
        return self.hand.get_pos().to(self.device) - self._tip

    def _observe(self) -> Observation:
        qpos = self.robot.get_dofs_position().to(self.device)
        parts = [qpos] + [self.workspace_units(p) for p in
                          [self.tip_pos(), self.ee_target] + ([self.goal] if self.privileged else [])]
        if self.camera is not None:
            # forced: genesis updates what it draws once per simulation step, and a reset takes
            # none (the frame would show the episode before)
            rgb = np.asarray(self.camera.render(rgb=True, force_render=True)[0])
            if rgb.ndim == 3:
                rgb = rgb[None]
            image = torch.from_numpy(np.ascontiguousarray(rgb)).permute(0, 3, 1, 2).to(self.device)
        else:
            image = torch.zeros(self.n_envs, *self.spec.image_shape, dtype=torch.uint8, device=self.device)
        return Observation(
            image=image, proprio=torch.cat(parts, dim=-1).float(), instruction=[self.instruction] * self.n_envs
        )


class GenesisReachEnv(GenesisFrankaEnv):
    """Move the gripper to a red sphere; success within 5 cm."""

    task_object = "sphere"
    instruction = "move the gripper to the red ball"
    success_threshold = 0.05

    def _sample_goal(self, g: int) -> Tensor:
        lo = torch.tensor([0.4, -0.2, 0.1])
        hi = torch.tensor([0.65, 0.2, 0.35])
        return lo + torch.rand(g, 3, generator=self.generator) * (hi - lo)

    def _place_object(self, envs: Tensor) -> None:
        self.obj.set_pos(self.goal[envs], envs_idx=envs)

    def _distance(self) -> Tensor:
        return (self.tip_pos() - self.goal).norm(dim=-1)


class GenesisLiftEnv(GenesisFrankaEnv):
    """Pick up a red cube and lift it 10 cm; shaping follows gripper-to-cube distance
    plus the remaining lift height."""

    task_object = "cube"
    instruction = "pick up the red cube and lift it"
    lift_height = 0.10
    success_threshold = 1e-6  # distance is exactly 0 once the cube is high enough

    def _sample_goal(self, g: int) -> Tensor:
        xy = torch.tensor([0.5, -0.15]) + torch.rand(g, 2, generator=self.generator) * torch.tensor([0.2, 0.3])
        return torch.cat([xy, torch.full((g, 1), 0.02)], dim=-1)

    def _place_object(self, envs: Tensor) -> None:
        self.obj.set_pos(self.goal[envs], envs_idx=envs)
        quat = torch.tensor([[1.0, 0.0, 0.0, 0.0]], device=self.device).repeat(len(envs), 1)
        self.obj.set_quat(quat, envs_idx=envs)  # upright and at rest, in these envs only
        self.obj.zero_all_dofs_velocity(envs_idx=envs)

    def _distance(self) -> Tensor:
        cube = self.obj.get_pos().to(self.device)
        height = cube[:, 2] - self.goal[:, 2]
        remaining = (self.lift_height - height).clamp(min=0.0)
        if_lifted = remaining <= 0
        reach = (self.tip_pos() - cube).norm(dim=-1)
        return torch.where(if_lifted, torch.zeros_like(reach), reach + 2.0 * remaining)
