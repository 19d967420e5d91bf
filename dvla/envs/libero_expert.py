"""A scripted expert for LIBERO's pick-and-place tasks (every task of ``libero_spatial``: "pick
up the black bowl ... and place it on the plate").

It reads the simulator's privileged state through the env (:meth:`LiberoEnv.privileged`: the
positions of the task's goal objects, the effector's pose, the shapes of the other objects)
and acts through the same 7-D actions a policy sends to
:class:`dvla.envs.libero_env.LiberoEnv`: OSC_POSE deltas in [-1, 1] (position in units of
5 cm, rotation in units of 0.5 rad, LIBERO's ``output_max``; gripper -1 open, +1 close). One
state machine per env steps through the waypoints

    approach (above the grasp point) -> descend -> close -> lift -> carry (above the plate)
    -> lower -> open -> retreat

with proportional control towards each waypoint, the gripper pointing straight down at a
yaw held for the whole grasp. The bowl is concave: closing at its centre closes on nothing,
so the expert grasps its rim, one finger inside the bowl and one outside. Where on the rim
(and so the yaw) is chosen per episode from the scene: of a few candidates, the one where
the gripper (fingers and hand, sampled as points) collides with the fewest other objects'
geoms on its way down. A grasp that is blocked on the way down or does not lift the bowl is
tried again at the next candidate. The goal object and its target come from the task's BDDL
goal (``(On akita_black_bowl_1 plate_1)``), never from the instruction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

POS_UNIT, ROT_UNIT = 0.05, 0.5
"""Metres and radians per unit of action (LIBERO's OSC_POSE controller's ``output_max``)."""
OPEN, CLOSE = -1.0, 1.0
PHASES = ("approach", "descend", "close", "lift", "carry", "lower", "open", "retreat", "rise")
APPROACH, DESCEND, GRASP, LIFT, CARRY, LOWER, RELEASE, RETREAT, RISE = range(len(PHASES))
DOWN = np.array([1.0, 0.0, 0.0, 0.0])
"""The effector pointing straight down, fingers closing along world y (quaternion x, y, z, w;
LIBERO's start pose up to a few degrees); a grasp's yaw turns it about world z."""
YAWS = np.deg2rad([0.0, 30.0, -30.0, 60.0, -60.0, 90.0])
"""Candidate yaws; with the rim point on either side along the closing axis, 12 grasps."""
_HAND = ((-0.027, 0.037), (-0.100, 0.104), (0.030, 0.123))  # Panda hand / fingers around the
_FINGER = ((-0.009, 0.013), (0.039, 0.065), (-0.010, 0.045))  # effector, at yaw 0, fingers open


def _grid(box, n) -> np.ndarray:
    axes = [np.linspace(lo, hi, k) for (lo, hi), k in zip(box, n)]
    return np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)


GRIPPER_POINTS = np.concatenate([_grid(_HAND, (3, 9, 3)), _grid(_FINGER, (3, 3, 5)),
                                 _grid(_FINGER, (3, 3, 5)) * [1.0, -1.0, 1.0]])
"""Points sampling the gripper's collision volume, relative to the effector at yaw 0."""


@dataclass(frozen=True)
class ExpertParams:
    grasp_radius: float = 0.045
    """Grasp point's distance from the bowl's axis (its rim is at about 0.047 m)."""
    grasp_height: float = 0.035
    """Effector above the bowl's origin at the grasp (the rim's top is at about 0.052 m)."""
    hover: float = 0.08
    """Approach height above the grasp point."""
    carry_clearance: float = 0.10
    """Bowl's origin above the target's (and at least this above where it started) while carrying."""
    drop: float = 0.015
    """Bowl's origin above the target's when the gripper opens."""
    gain: float = 2.0
    """Action per (error / POS_UNIT)."""
    max_speed: float = 1.0
    """Largest position action (horizontal norm, and vertical); half of it near the objects."""
    rot_gain: float = 1.0
    tol: float = 0.01
    close_steps: int = 10
    open_steps: int = 6
    stall_steps: int = 8
    """Steps without getting 2 mm closer to the waypoint on the way to a grasp: blocked."""
    phase_timeout: int = 60
    """Steps in a moving phase before the next one starts anyway."""
    retries: int = 3
    margin: float = 0.005
    """Added around the other objects' geoms when scoring grasps."""


def goal_objects(goal) -> tuple[str, str]:
    """``(object, target)`` of a task whose goal is one ``(On object target)`` predicate; any
    other goal is a one-line ValueError (a task the expert does not cover)."""
    preds = [list(p) for p in goal]
    if len(preds) != 1 or len(preds[0]) != 3 or str(preds[0][0]).lower() != "on":
        raise ValueError(f"libero expert: covers pick-and-place goals (On object target) only, not {preds}")
    return str(preds[0][1]), str(preds[0][2])


def _quat_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    (ax, ay, az, aw), (bx, by, bz, bw) = a, b
    return np.array([aw * bx + ax * bw + ay * bz - az * by, aw * by - ax * bz + ay * bw + az * bx,
                     aw * bz + ax * by - ay * bx + az * bw, aw * bw - ax * bx - ay * by - az * bz])


def yaw_quat(yaw: float) -> np.ndarray:
    """:data:`DOWN` turned by ``yaw`` about world z."""
    return _quat_mul(np.array([0.0, 0.0, np.sin(yaw / 2), np.cos(yaw / 2)]), DOWN)


def rotation_error(target: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Axis-angle (world frame) of the rotation taking ``current`` to ``target`` (x, y, z, w)."""
    q = _quat_mul(target, current * np.array([-1.0, -1.0, -1.0, 1.0]))
    q = q if q[3] >= 0 else -q
    s = np.linalg.norm(q[:3])
    return np.zeros(3) if s < 1e-9 else q[:3] * (2.0 * np.arctan2(s, q[3]) / s)


def closing_axis(yaw: float) -> np.ndarray:
    return np.array([-np.sin(yaw), np.cos(yaw), 0.0])


def quat_matrix(q: np.ndarray) -> np.ndarray:
    """Rotation matrix of a unit quaternion (x, y, z, w)."""
    x, y, z, w = q
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                     [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                     [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])


def grasp_point(obj: np.ndarray, obj_rot: np.ndarray, yaw: float, side: float, p: ExpertParams) -> np.ndarray:
    """Where the effector grasps the rim: ``grasp_radius`` from the bowl's axis towards
    ``side`` of the closing axis, ``grasp_height`` up the axis, in the bowl's own frame (a
    bowl resting tilted, on a ramekin, has its rim off its origin's vertical)."""
    axis = obj_rot.T @ closing_axis(yaw)
    axis[2] = 0.0
    axis /= max(np.linalg.norm(axis), 1e-6)
    return obj + obj_rot @ (side * p.grasp_radius * axis + [0.0, 0.0, p.grasp_height])


def rank_grasps(obj: np.ndarray, obj_rot: np.ndarray, boxes, p: ExpertParams) -> list[tuple[float, float]]:
    """The candidate grasps ``(yaw, side)`` of the bowl at ``obj``, fewest collisions first
    (then least yaw): the gripper's points at the grasp and on the way down to it, inside the
    other objects' geoms (``boxes``: centres (G, 3), rotations (G, 3, 3), half sizes (G, 3))."""
    cands = [(float(y), s) for y in YAWS for s in (1.0, -1.0)]
    if boxes is None or len(boxes[0]) == 0:
        return cands
    centre, rot, half = boxes
    scores = []
    for yaw, side in cands:
        c, s = np.cos(yaw), np.sin(yaw)
        turn = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
        eef = grasp_point(obj, obj_rot, yaw, side, p)
        pts = np.concatenate([GRIPPER_POINTS @ turn.T + eef + [0.0, 0.0, dz] for dz in (0.0, 0.04, 0.08)])
        local = np.einsum("gji,ngj->ngi", rot, pts[:, None, :] - centre[None])
        hits = int(np.all(np.abs(local) <= half + p.margin, axis=-1).any(axis=1).sum())
        scores.append((hits, abs(yaw)))
    order = sorted(range(len(cands)), key=lambda i: scores[i])
    return [cands[i] for i in order]


class PickPlaceExpert:
    """The state machines of ``n_envs`` envs, from plain arrays (no simulator needed)."""

    def __init__(self, n_envs: int, params: ExpertParams | None = None):
        self.n_envs, self.p = n_envs, params or ExpertParams()
        self.phase = np.zeros(n_envs, int)
        self._t = np.zeros(n_envs, int)
        self._tries = np.zeros(n_envs, int)
        self._grasps: list[list | None] = [None] * n_envs  # ranked (yaw, side) per env
        self._hold = np.zeros((n_envs, 3))  # effector position a phase holds
        self._start_z = np.zeros(n_envs)  # the object's height when the episode started
        self._best = np.zeros(n_envs)  # closest to the waypoint in this phase, and since when
        self._since = np.zeros(n_envs, int)
        self.reset()

    def reset(self, envs=None) -> None:
        """Start a new episode's state machine in ``envs`` (all by default)."""
        for j in range(self.n_envs) if envs is None else [int(j) for j in envs]:
            self._goto(j, APPROACH)
            self._tries[j], self._grasps[j] = 0, None

    @property
    def needs_scene(self) -> list[int]:
        """Envs whose next :meth:`act` chooses a grasp (``state`` should carry ``boxes``)."""
        return [j for j in range(self.n_envs) if self._grasps[j] is None]

    def grasp(self, j: int) -> tuple[float, float]:
        """Env ``j``'s current grasp, ``(yaw, side)``."""
        return self._grasps[j][self._tries[j] % len(self._grasps[j])]

    def _goto(self, j: int, phase: int) -> None:
        self.phase[j], self._t[j], self._best[j], self._since[j] = phase, 0, np.inf, 0

    def _retry(self, j: int, eef: np.ndarray) -> None:
        """A failed grasp: rise, then the next candidate (or give up and retreat)."""
        self._tries[j] += 1
        self._goto(j, RISE if self._tries[j] <= self.p.retries else RETREAT)
        self._hold[j] = eef + [0.0, 0.0, self.p.hover]

    def act(self, state: dict) -> np.ndarray:
        """Actions ``(n_envs, 7)`` (float32) from ``state``: ``eef_pos`` (n, 3), ``eef_quat``
        (n, 4, x y z w), ``obj_pos`` and ``target_pos`` (n, 3), optionally ``obj_quat`` (n, 4;
        default upright) and, for the envs in
        :attr:`needs_scene`, ``boxes`` (per env the other objects' geoms, see
        :func:`rank_grasps`; None: unknown, the candidates in their fixed order)."""
        out = np.zeros((self.n_envs, 7), np.float32)
        boxes = state.get("boxes") or [None] * self.n_envs
        quats = state.get("obj_quat")
        for j in range(self.n_envs):
            obj = np.asarray(state["obj_pos"][j], float)
            rot = np.eye(3) if quats is None else quat_matrix(np.asarray(quats[j], float))
            if self._grasps[j] is None:
                self._grasps[j] = rank_grasps(obj, rot, boxes[j], self.p)
                self._start_z[j] = obj[2]
            out[j] = self._act_one(j, np.asarray(state["eef_pos"][j], float), np.asarray(state["eef_quat"][j], float),
                                   obj, rot, np.asarray(state["target_pos"][j], float))
        return out

    def _blocked(self, j: int, dist: float) -> bool:
        """No 2 mm of progress towards the waypoint for ``stall_steps`` steps."""
        if dist < self._best[j] - 0.002:
            self._best[j], self._since[j] = dist, 0
        else:
            self._since[j] += 1
        return self._since[j] > self.p.stall_steps

    def _act_one(self, j: int, eef, quat, obj, obj_rot, target) -> np.ndarray:
        p = self.p
        yaw, side = self.grasp(j)
        self._t[j] += 1
        grasp = grasp_point(obj, obj_rot, yaw, side, p)
        carry_z = max(target[2], self._start_z[j]) + p.carry_clearance  # the object's origin, carrying
        held = eef - obj  # the effector relative to the object, while holding it
        turn = rotation_error(yaw_quat(yaw), quat)
        phase, t, gripper, speed = self.phase[j], self._t[j], CLOSE, p.max_speed
        if phase == RISE:
            aim, gripper = self._hold[j], OPEN
            if abs(aim[2] - eef[2]) < 2 * p.tol or t > p.phase_timeout // 4:
                self._goto(j, APPROACH)
        elif phase == APPROACH:
            goal = grasp + [0.0, 0.0, p.hover]
            aim, gripper, far = goal.copy(), OPEN, np.linalg.norm((goal - eef)[:2])
            if far > 0.03:  # not lower than now until above the grasp
                aim[2] = max(aim[2], eef[2])
            if far < p.tol and abs(goal[2] - eef[2]) < 2 * p.tol and np.linalg.norm(turn) < 0.1:
                self._goto(j, DESCEND)
            elif self._blocked(j, float(np.linalg.norm(goal - eef))):
                self._retry(j, eef)
        elif phase == DESCEND:
            aim, gripper, speed = grasp, OPEN, p.max_speed / 2
            dist = float(np.linalg.norm(aim - eef))
            if dist < p.tol / 2 or (self._blocked(j, dist) and eef[2] - grasp[2] < p.tol):
                self._goto(j, GRASP)
                self._hold[j] = eef
            elif self._since[j] > p.stall_steps:  # blocked above the grasp point
                self._retry(j, eef)
        elif phase == GRASP:
            aim = self._hold[j]
            if t >= p.close_steps:
                self._goto(j, LIFT)
                self._hold[j] = eef
        elif phase in (LIFT, CARRY, LOWER):
            if phase == LIFT:
                aim = np.array([*self._hold[j][:2], carry_z + held[2]])
                if obj[2] > carry_z - 2 * p.tol or t > p.phase_timeout:
                    self._goto(j, CARRY)
            elif phase == CARRY:
                aim = np.array([target[0], target[1], carry_z]) + held
                off = float(np.linalg.norm((target - obj)[:2]))  # stuck (an arm's limit): lower anyway
                if off < p.tol or (self._blocked(j, off) and off < 2 * p.tol) or t > 2 * p.phase_timeout:
                    self._goto(j, LOWER)
            else:
                aim = target + [0.0, 0.0, p.drop] + held
                off = float(np.linalg.norm((target - obj)[:2]))
                if off > 1.5 * p.tol and not self._blocked(j, off):  # centre it first, while that progresses
                    aim[2] = eef[2]
                if obj[2] - target[2] < 0.05:
                    speed = p.max_speed / 2
                if obj[2] - target[2] < p.drop + p.tol / 2 or t > p.phase_timeout:
                    self._goto(j, RELEASE)
                    self._hold[j] = eef
            if held[2] > p.grasp_height + 0.04 and phase != LOWER:  # it slipped out: try again
                self._retry(j, eef)
        elif phase == RELEASE:
            aim, gripper = self._hold[j], OPEN
            if t >= p.open_steps:
                self._goto(j, RETREAT)
                self._hold[j] = eef + [0.0, 0.0, p.hover]
        else:  # RETREAT
            aim, gripper = self._hold[j], OPEN
        if self.phase[j] in (RISE, RETREAT) and phase != RELEASE:
            gripper = OPEN
        move = p.gain * (np.asarray(aim, float) - eef) / POS_UNIT
        flat = np.linalg.norm(move[:2])
        if flat > speed:
            move[:2] *= speed / flat
        move[2] = np.clip(move[2], -speed, speed)
        turn = np.clip(p.rot_gain * turn / ROT_UNIT, -1.0, 1.0)
        return np.clip(np.concatenate([move, turn, [gripper]]), -1.0, 1.0)


class LiberoExpert:
    """:class:`PickPlaceExpert` over the envs of a :class:`dvla.envs.libero_env.LiberoEnv`:
    :meth:`act` reads the env's privileged state and returns the actions ``(n_envs, 1, 7)``
    (float32, on the env's device) to pass to ``env.step``."""

    def __init__(self, env, params: ExpertParams | None = None):
        self.env = env
        self.machine = PickPlaceExpert(env.n_envs, params)
        self._names: list[tuple[str, str]] | None = None

    def reset(self, envs=None) -> None:
        self.machine.reset(envs)

    def state(self) -> dict:
        """The privileged state in :meth:`PickPlaceExpert.act`'s terms."""
        s = self.env.privileged(geoms=bool(self.machine.needs_scene))
        if self._names is None:
            self._names = [goal_objects(g) for g in s["goal"]]
        obj = np.stack([objs[o] for objs, (o, _) in zip(s["objects"], self._names)])
        target = np.stack([objs[t] for objs, (_, t) in zip(s["objects"], self._names)])
        quat = np.stack([q[o] for q, (o, _) in zip(s["quats"], self._names)])
        out = {"eef_pos": s["eef_pos"], "eef_quat": s["eef_quat"], "obj_pos": obj, "obj_quat": quat,
               "target_pos": target}
        if "geoms" in s:  # every object's geoms but the one to grasp
            out["boxes"] = [tuple(np.concatenate(parts) for parts in zip(*[b for n, b in geoms.items() if n != o]))
                            for geoms, (o, _) in zip(s["geoms"], self._names)]
        return out

    def act(self) -> torch.Tensor:
        return torch.from_numpy(self.machine.act(self.state())).unsqueeze(1).to(self.env.device)


def run_episodes(env, expert: LiberoExpert, max_steps: int) -> tuple[torch.Tensor, int]:
    """One episode in every env of ``env`` (reset, then expert actions until every env
    succeeded or ``max_steps``): ``(success per env, steps taken)``."""
    env.reset()
    expert.reset()
    success = torch.zeros(env.n_envs, dtype=torch.bool)
    steps = 0
    while steps < max_steps and not bool(success.all()):
        res = env.step(expert.act())
        steps += 1
        success |= res.success.cpu()
    return success, steps
