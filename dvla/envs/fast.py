"""A vectorised pure-torch reaching task with the same interface as the simulator envs.

A point effector moves in the plane ``[-1, 1]^2`` by ``max_delta * action`` per control
step. ``n_targets`` coloured targets are drawn; the instruction names the one to reach
("move to the red target"). The camera image is a top-down rendering: targets are
coloured discs, the effector a white disc. ``options.wrist_camera=N`` adds a second
camera (``Observation.cameras["wrist"]``, N x N pixels): a close view centred on the
effector. Proprio is the effector position (and, with ``options.privileged=true``, the goal
position too, for state-based baselines).

``options.long_tail=A`` (A > 0) gives episode lengths a heavy tail: every episode (every
GRPO group: it is part of the task) draws a slowness ``s`` from a Pareto distribution of
shape A (``P(s > x) = x^-A`` for x >= 1), capped at ``options.long_tail_cap``, and the
effector moves ``max_delta / s`` per step. Most episodes run as usual; a few take many times
longer (A = 1.5: one in ten is 4.6x slower or more). It is the workload on which episodes
that wait for the slowest of their batch leave most envs idle. 0 (the default) draws nothing.

It runs thousands of steps per second, which makes it the env of choice for tests
and for measuring framework overhead; ``options.render_cost_ms`` adds that much CPU work
per rendered observation to imitate a slow simulator in benchmarks, and
``options.phase_after=N`` switches it to ``options.render_cost_ms_after`` once the env has
rendered N observations, ``options.phase_after_s=S`` once S seconds have passed since it was
built (a workload whose phases shift mid-run; in seconds, the shift comes at the same time
however many env groups share the work), ``options.phase_file=PATH`` while the file PATH
exists (a shift that something outside the run decides, when it sees the run reach a state:
a test, an operator; checked at every render), and ``options.render_wait_ms_after`` likewise
replaces ``render_wait_ms`` in the second phase. The work (hashing a
buffer) runs in native code with the GIL released, as a C++/CUDA simulator's would, so
other threads (inference, learning) can overlap with it. ``options.render_wait_ms`` instead
waits that long per render without using a core: a simulator on another, slower host, so
that one machine can stand in for a cluster whose ranks differ in speed.
``options.render_python_ms`` (and ``render_python_ms_after`` for the second phase) spends
that long per render in pure Python, holding the GIL, as a simulator written in Python does:
then the other lanes' threads cannot run beside it.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch
from torch import Tensor

from dvla.config import EnvConfig
from dvla.envs.base import EnvSpec, GoalEnv
from dvla.envs.options import Option
from dvla.types import Observation

_BURN = bytes(64 << 10)
MAX_MS = 1000  # at most a second of simulated cost per render
COLORS = {
    "red": (230, 40, 40),
    "blue": (40, 80, 230),
    "green": (40, 200, 60),
    "yellow": (230, 210, 40),
}


def _per_phase(opts: dict, key: str) -> tuple[float, float]:
    """Seconds of ``opts[key]`` (ms) before and after the phase shift; ``key_after`` None
    leaves it as it was."""
    before, after = float(opts[key]) / 1000.0, opts[f"{key}_after"]
    return before, before if after is None else float(after) / 1000.0


def _hold_gil(seconds: float) -> None:
    """Busy for ``seconds`` in pure Python, holding the GIL (a Python simulator's step)."""
    end, x = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        for i in range(100):
            x += i


class FastReachEnv(GoalEnv):
    OPTIONS = {
        "n_targets": Option(1, "coloured targets drawn; the instruction names the one to reach", kind="int",
                            ge=1, le=len(COLORS)),
        "max_delta": Option(0.15, "how far the effector moves per control step at full action", gt=0, le=1),
        "privileged": Option(False, "proprio carries the goal position too", kind="bool"),
        "radius": Option(0.15, "distance to the target that counts as reaching it", gt=0, le=2),
        "render_cost_ms": Option(0.0, "CPU work per render, in ms (a costlier simulator)", ge=0, le=MAX_MS),
        "wrist_camera": Option(0, "side in pixels of a second, close-up camera (0: none)", kind="int", ge=0,
                               le=1024),
        "long_tail": Option(0.0, "Pareto shape A of episode slowness (0: none): a few episodes take many times "
                            "longer", ge=0, le=100),
        "long_tail_cap": Option(20.0, "the largest slowness of long_tail", ge=1, le=1000),
        "phase_after": Option(0, "renders before the second phase's costs apply (0: never)", kind="int", ge=0,
                              le=2**62),
        "phase_after_s": Option(0.0, "seconds before the second phase (0: never)", ge=0, le=1e7),
        "render_cost_ms_after": Option(0.0, "render_cost_ms in the second phase", ge=0, le=MAX_MS),
        "render_wait_ms": Option(0.0, "a wait per render, in ms, without a core (a renderer on its own hardware)",
                                 ge=0, le=MAX_MS),
        "render_wait_ms_after": Option(None, "render_wait_ms in the second phase (null: as in the first)", ge=0,
                                       le=MAX_MS, none=True),
        "render_python_ms": Option(0.0, "work in Python per render, in ms, holding the GIL", ge=0, le=MAX_MS),
        "render_python_ms_after": Option(None, "render_python_ms in the second phase (null: as in the first)",
                                         ge=0, le=MAX_MS, none=True),
        "phase_file": Option("", "a path: the second phase while the file exists ('': none)", kind="str"),
    }
    WRIST_VIEW = 0.35  # half-width of the wrist camera's view around the effector

    @classmethod
    def spec_for(cls, cfg: EnvConfig) -> EnvSpec:
        privileged = bool(cls.options_of(cfg, cls.OPTIONS)["privileged"])
        s, w = cfg.image_size, int(cls.options_of(cfg, cls.OPTIONS)["wrist_camera"])
        cameras = (("wrist", (3, w, w)),) if w else ()
        return EnvSpec(image_shape=(3, s, s), proprio_dim=4 if privileged else 2, action_dim=2, cameras=cameras)

    @classmethod
    def check_config(cls, cfg: EnvConfig) -> dict:
        """``cfg.options`` over the defaults, checked without building an env (ConfigError)."""
        return cls.options_of(cfg, cls.OPTIONS)

    def __init__(self, cfg: EnvConfig, device: torch.device | str = "cpu", seed: int = 0):
        super().__init__(cfg, device, seed)
        opts = self.check_config(cfg)
        self.n_targets = int(opts["n_targets"])
        self.max_delta = float(opts["max_delta"])
        self.privileged = bool(opts["privileged"])
        self.success_threshold = float(opts["radius"])
        # (first phase, second phase) seconds per render: native work, a wait, work in Python
        self.render_cost = _per_phase(opts, "render_cost_ms")
        self.render_wait = _per_phase(opts, "render_wait_ms")
        self.render_python = _per_phase(opts, "render_python_ms")
        self.phase_after = int(opts["phase_after"])
        self.phase_at = time.perf_counter() + float(opts["phase_after_s"]) if opts["phase_after_s"] else None
        self.phase_file = opts["phase_file"]
        self.renders = 0
        self.wrist = int(opts["wrist_camera"])
        self.long_tail, self.long_tail_cap = float(opts["long_tail"]), float(opts["long_tail_cap"])
        s = cfg.image_size
        self.spec = self.spec_for(cfg)
        lin = torch.linspace(-1.0, 1.0, s, device=self.device)
        self._gy, self._gx = torch.meshgrid(lin, lin, indexing="ij")
        self._colors = torch.tensor(list(COLORS.values()), dtype=torch.float32, device=self.device)
        self._names = list(COLORS)
        b = self.n_envs
        self.pos = torch.zeros(b, 2, device=self.device)
        self.targets = torch.zeros(b, self.n_targets, 2, device=self.device)
        self.goal_idx = torch.zeros(b, dtype=torch.long, device=self.device)
        self.slowness = torch.ones(b, device=self.device)  # each episode's (options.long_tail; 1: as usual)

    def _draw(self, g: int) -> tuple[Tensor, ...]:
        """Initial effector positions, targets, goal indices and slowness of ``g`` episodes."""
        gen = self.generator
        pos = torch.rand(g, 2, generator=gen) * 1.6 - 0.8
        targets = torch.rand(g, self.n_targets, 2, generator=gen) * 1.6 - 0.8
        goal = torch.randint(0, self.n_targets, (g,), generator=gen)
        slow = torch.ones(g)
        if self.long_tail > 0:  # Pareto(A) by inversion, drawn after the task (the default draws nothing)
            u = torch.rand(g, generator=gen)
            slow = (1.0 - u).pow(-1.0 / self.long_tail).clamp(max=self.long_tail_cap)
        return pos, targets, goal, slow

    def _reset_task(self, group_size: int) -> None:
        self._reset_task_envs(torch.arange(self.n_envs, device=self.device), group_size)

    def _reset_task_envs(self, envs: Tensor, group_size: int) -> None:
        drawn = [self.group_repeat(x, group_size).to(self.device) for x in self._draw(len(envs) // group_size)]
        for name, x in zip(("pos", "targets", "goal_idx", "slowness"), drawn):
            getattr(self, name)[envs] = x

    @property
    def goal(self) -> Tensor:
        return self.targets[torch.arange(self.n_envs, device=self.device), self.goal_idx]

    def _apply(self, action: Tensor) -> None:
        self.pos = (self.pos + self.max_delta * action / self.slowness[:, None]).clamp(-1.0, 1.0)

    def _distance(self) -> Tensor:
        return (self.pos - self.goal).norm(dim=-1)

    def _render(self, size: int | None = None, around: Tensor | None = None) -> Tensor:
        """The top-down view; with ``around`` ((B, 2)), a ``size``-pixel view of half-width
        ``WRIST_VIEW`` centred there (the wrist camera)."""
        b, s = self.n_envs, size or self.cfg.image_size
        img = torch.zeros(b, 3, s, s, device=self.device)
        sigma2 = 2 * (0.06**2)
        if around is None:
            gx, gy = self._gx, self._gy
        else:
            lin = torch.linspace(-self.WRIST_VIEW, self.WRIST_VIEW, s, device=self.device)
            gy, gx = torch.meshgrid(lin, lin, indexing="ij")
            gx = gx + around[:, 0, None, None]
            gy = gy + around[:, 1, None, None]

        def blob(p: Tensor) -> Tensor:  # (B, 2) -> (B, 1, S, S)
            d2 = (gx - p[:, 0, None, None]) ** 2 + (gy - p[:, 1, None, None]) ** 2
            return torch.exp(-d2 / sigma2).unsqueeze(1)

        for j in range(self.n_targets):
            img += blob(self.targets[:, j]) * self._colors[j].view(1, 3, 1, 1)
        img += blob(self.pos) * 255.0
        self.renders += around is None
        shifted = (self.phase_after and self.renders > self.phase_after) or (
            self.phase_at is not None and time.perf_counter() >= self.phase_at) or (
            self.phase_file and os.path.exists(self.phase_file))
        cost, wait, held = (x[1 if shifted else 0] for x in (self.render_cost, self.render_wait, self.render_python))
        if cost > 0:
            end = time.perf_counter() + cost
            while time.perf_counter() < end:
                hashlib.sha256(_BURN)  # native, GIL released for buffers over 2 KiB
        if wait > 0:
            time.sleep(wait)
        if held > 0:
            _hold_gil(held)
        return img.clamp_(0, 255).to(torch.uint8)

    def _observe(self) -> Observation:
        proprio = torch.cat([self.pos, self.goal], dim=-1) if self.privileged else self.pos.clone()
        image = self._render() if self.cfg.render else torch.zeros(
            self.n_envs, *self.spec.image_shape, dtype=torch.uint8, device=self.device
        )
        names = [self._names[i] for i in self.goal_idx.tolist()]
        instruction = [f"move to the {n} target" for n in names]
        cameras = {"wrist": self._render(self.wrist, around=self.pos)} if self.wrist else {}
        return Observation(image=image, proprio=proprio, instruction=instruction, cameras=cameras)
