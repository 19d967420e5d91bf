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

from dvla.config import ConfigError, EnvConfig
from dvla.envs.base import EnvSpec, GoalEnv
from dvla.types import Observation

_BURN = bytes(64 << 10)
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
    OPTIONS = {"n_targets": 1, "max_delta": 0.15, "privileged": False, "radius": 0.15,
               "render_cost_ms": 0.0, "wrist_camera": 0, "long_tail": 0.0, "long_tail_cap": 20.0,
               "phase_after": 0, "phase_after_s": 0.0, "render_cost_ms_after": 0.0, "render_wait_ms": 0.0,
               "render_wait_ms_after": None, "render_python_ms": 0.0, "render_python_ms_after": None,
               "phase_file": ""}
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
        opts = cls.options_of(cfg, cls.OPTIONS)
        n = opts["n_targets"]
        if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= len(COLORS)):
            raise ConfigError(f"env.options.n_targets: must be an integer in [1, {len(COLORS)}], got {n!r}")
        for key in ("max_delta", "radius", "render_cost_ms", "long_tail", "render_cost_ms_after", "phase_after_s",
                    "render_wait_ms", "render_wait_ms_after", "render_python_ms", "render_python_ms_after"):
            v = opts[key]
            if v is None and cls.OPTIONS[key] is None:  # an ``_after`` left as in the first phase
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(f"env.options.{key}: must be a number >= 0, got {v!r}")
        cap = opts["long_tail_cap"]
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 1:
            raise ConfigError(f"env.options.long_tail_cap: the largest slowness, a number >= 1, got {cap!r}")
        n = opts["phase_after"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"env.options.phase_after: renders before render_cost_ms_after applies (0: never), "
                              f"got {n!r}")
        if not isinstance(opts["phase_file"], str):
            raise ConfigError(f"env.options.phase_file: a path (the second phase while it exists; '': none), "
                              f"got {opts['phase_file']!r}")
        w = opts["wrist_camera"]
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ConfigError(f"env.options.wrist_camera: the wrist camera's side in pixels (0: none), got {w!r}")
        if not isinstance(opts["privileged"], bool):
            raise ConfigError(f"env.options.privileged: must be true or false, got {opts['privileged']!r}")
        return opts

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
