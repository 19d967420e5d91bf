"""Framework overhead: dvla against a plain single-threaded PPO loop on a cheap task.

Both sides run the same gymnasium vector env (16 envs by default, ``Pendulum-v1`` or any
Box-action task), the same network (a 2x64 tanh MLP on the state, a Gaussian head with a
learned log-std, a value head), the same PPO settings (epochs, minibatches, clipping,
GAE), one torch thread and no images. The reference loop is the simplest honest one: step
all envs, one forward pass, learn every ``T`` steps (:func:`reference_ppo`, about a hundred
lines). dvla runs the same work through its lanes in several settings:

* ``sync``: the serial driver, one thread;
* ``async``: the default lanes (threads);
* ``turns``: async with ``swimlane.take_turns`` (inference inline, simulation and updates
  one at a time);
* ``autotune``: async with ``swimlane.autotune`` (starting from 2 env groups, turns off);
* ``procs``: the Sample Factory layout, lanes in two processes: ``torchrun`` starts a
  learner rank and a rollout rank (``swimlane.colocate=false``, the rollout rank taking
  turns: its inference inline), joined by the data plane. Its figure is the learner
  rank's, from its own start, as for the others (process start-up not counted);
* ``procs_autotune``: the same layout with ``swimlane.autotune`` on the rollout rank
  instead (turns off at the start: the controller has to find them).

Runs alternate (the order rotates between repeats); printed per repeat and as medians: env
steps per second, and each ratio to the reference measured in the same repeat.
Targets (issue #20): sync >= 0.9x, autotune >= 1.0x, and async never below sync once
autotune chooses.

``--budget`` instead times where a decision step goes, in microseconds: the reference's
simulator, rest of the rollout and learning; dvla sync's simulator, env wrapper, recorder,
inference, batch starts, learner and the rest (driver and glue). Timers wrap the methods
for the run (about a microsecond per call).

    python bench/overhead.py --repeats 3
    python bench/overhead.py --budget --updates 300
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dvla import PolicyOutput, PolicySpec, VLAPolicy, register_policy
from dvla.config import AlgoConfig, EnvConfig, JobConfig, PolicyConfig, RunConfig, SwimlaneConfig, apply_overrides
from dvla.distributions import GaussianActionDistribution
from dvla.policy import HashTokenizer
from swimlane import Swimlane


class MLP(nn.Module):
    """The network both sides train: state -> (tanh mean, value), plus a log-std."""

    def __init__(self, obs_dim: int, act_dim: int, width: int = 64):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(obs_dim, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())
        self.mean, self.value = nn.Linear(width, act_dim), nn.Linear(width, 1)
        self.log_std = nn.Parameter(torch.full((act_dim,), -0.5))

    def forward(self, x):
        z = self.trunk(x)
        return torch.tanh(self.mean(z)), self.value(z).squeeze(-1)


@register_policy("bench_state_mlp")
class StateMLP(VLAPolicy):
    """:class:`MLP` as a dvla policy (reads the proprio, ignores image and instruction)."""

    has_value_head = True

    @dataclass(kw_only=True)
    class Config:
        width: int = 64

    def __init__(self, spec: PolicySpec, config: StateMLP.Config):
        super().__init__(spec, config)
        self.tokenizer = HashTokenizer(64, 4)
        self.net = MLP(spec.proprio_dim, spec.action_chunk * spec.action_dim, config.width)

    def forward(self, obs):
        mean, value = self.net(obs.proprio.float())
        k, a = self.spec.action_chunk, self.spec.action_dim
        return PolicyOutput(dist=GaussianActionDistribution(mean.view(-1, k, a), self.net.log_std.view(1, k, a)),
                            value=value)


def reference_ppo(gym_id: str, n_envs: int, t_len: int, updates: int, algo: AlgoConfig, seed: int,
                  times: dict[str, float] | None = None) -> float:
    """The plain loop; returns env steps per second. ``times``: seconds of rollout and
    learning are added to it."""
    import gymnasium as gym

    torch.manual_seed(seed)
    envs = gym.make_vec(gym_id, num_envs=n_envs, vectorization_mode="sync")
    low, high = envs.single_action_space.low, envs.single_action_space.high
    net = MLP(envs.single_observation_space.shape[0], envs.single_action_space.shape[0])
    opt = torch.optim.Adam(net.parameters(), lr=algo.lr, eps=1e-5)
    obs, _ = envs.reset(seed=seed)
    start, steps = time.perf_counter(), 0
    for _ in range(updates):
        t0 = time.perf_counter()
        buf = {k: [] for k in ("obs", "act", "logp", "val", "rew", "term", "done")}
        with torch.no_grad():
            for _ in range(t_len):
                x = torch.as_tensor(obs, dtype=torch.float32)
                mean, value = net(x)
                dist = torch.distributions.Normal(mean, net.log_std.exp())
                act = dist.sample()
                a = act.clamp(-1, 1).numpy()
                obs, rew, term, trunc, _ = envs.step(low + (a + 1.0) * 0.5 * (high - low))
                for k, v in (("obs", x), ("act", act), ("logp", dist.log_prob(act).sum(-1)), ("val", value),
                             ("rew", torch.as_tensor(rew, dtype=torch.float32)),
                             ("term", torch.as_tensor(term, dtype=torch.float32)),
                             ("done", torch.as_tensor(term | trunc, dtype=torch.float32))):
                    buf[k].append(v)
                steps += n_envs
            last = net(torch.as_tensor(obs, dtype=torch.float32))[1]
        t1 = time.perf_counter()
        b = {k: torch.stack(v) for k, v in buf.items()}
        adv, gae_t = torch.zeros_like(b["rew"]), torch.zeros(n_envs)
        values = torch.cat([b["val"], last.unsqueeze(0)])
        for t in reversed(range(t_len)):
            delta = b["rew"][t] + algo.gamma * values[t + 1] * (1 - b["term"][t]) - values[t]
            gae_t = delta + algo.gamma * algo.gae_lambda * (1 - b["done"][t]) * gae_t
            adv[t] = gae_t
        ret = (adv + b["val"]).flatten()
        adv = ((adv - adv.mean()) / (adv.std() + 1e-8)).flatten()
        x, act, logp = b["obs"].flatten(0, 1), b["act"].flatten(0, 1), b["logp"].flatten()
        n = x.shape[0]
        for _ in range(algo.update_epochs):
            for idx in torch.randperm(n).chunk(algo.minibatches):
                mean, value = net(x[idx])
                new = torch.distributions.Normal(mean, net.log_std.exp()).log_prob(act[idx]).sum(-1)
                ratio = (new - logp[idx]).exp()
                pg = -torch.min(ratio * adv[idx], ratio.clamp(1 - algo.clip_eps, 1 + algo.clip_eps) * adv[idx]).mean()
                loss = pg + algo.value_coef * 0.5 * (value - ret[idx]).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(net.parameters(), algo.max_grad_norm)
                opt.step()
        if times is not None:
            times["rollout"] = times.get("rollout", 0.0) + t1 - t0
            times["learning"] = times.get("learning", 0.0) + time.perf_counter() - t1
    envs.close()
    return steps / (time.perf_counter() - start)


def _overrides(args) -> list[str]:
    return [f"env.n_envs={args.n_envs}", f"env.episode_len={args.t_len}", f"algo.update_epochs={args.epochs}",
            f"algo.minibatches={args.minibatches}", f"run.iterations={args.updates}"]


def procs_job(args, out: Path, tuned: bool) -> float:
    """``procs``: one learner rank and one rollout rank under torchrun; ``tuned``: with
    autotune on the rollout rank rather than turns set."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "dvla.launch",
           "--preset", "debug", "--import", __file__, "env.name=gym", "env.image_size=8", "env.render=false",
           f"env.options.gym_id={args.gym_id}", "policy.name=bench_state_mlp", "policy.action_chunk=1",
           "algo.name=ppo", f"run.out_dir={out}", "run.name=procs", "run.torch_threads=1", "run.progress=false",
           "run.save_every=0", "swimlane.env_groups=1", "swimlane.colocate=false", "swimlane.trace=false",
           *(["swimlane.autotune=true", f"swimlane.autotune_window_s={args.window_s}"] if tuned
             else ["swimlane.take_turns=true"]), *_overrides(args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
    s = json.loads((out / "procs" / "summary.json").read_text())
    return s["env_steps"] / s["wall_s"]


def dvla_job(args, out: Path, setting: str) -> float:
    if setting.startswith("procs"):
        return procs_job(args, out, tuned=setting == "procs_autotune")
    cfg = JobConfig(
        env=EnvConfig(name="gym", n_envs=args.n_envs, episode_len=args.t_len, image_size=8, render=False,
                      options={"gym_id": args.gym_id}),
        policy=PolicyConfig(name="bench_state_mlp", action_chunk=1),
        algo=AlgoConfig(name="ppo", update_epochs=args.epochs, minibatches=args.minibatches),
        run=RunConfig(iterations=args.updates, out_dir=str(out), torch_threads=1, progress=False, save_every=0),
        swimlane=SwimlaneConfig(env_groups=1, trace=setting == "autotune"))
    over = {"sync": ["swimlane.mode=sync", "swimlane.driver=serial"], "async": [], "turns": ["swimlane.take_turns=true"],
            "autotune": ["swimlane.env_groups=2", "swimlane.autotune=true",
                         f"swimlane.autotune_window_s={args.window_s}"]}
    s = Swimlane(apply_overrides(cfg, over[setting])).run()
    return s["env_steps"] / s["wall_s"]


BUDGET = (  # (label, "module:Class", method): the parts of a dvla sync run timed by --budget
    ("simulator", "gymnasium.vector:SyncVectorEnv", "step"),
    ("env wrapper", "dvla.envs.base:BatchedEnv", "step"),  # less the simulator inside it
    ("recorder", "dvla.rollout:EpisodeRecorder", "record"),
    ("inference", "swimlane.lanes.inference:InferenceLane", "_answer"),
    ("batch starts", "swimlane.lanes.sampling:SamplingLane", "start"),
    ("learner", "swimlane.lanes.learner:GradientLane", "learn"),
)


@contextmanager
def timed(targets, acc: dict[str, float]):
    """While inside: the seconds spent in each ``(label, "module:Class", method)`` of
    ``targets`` are added to ``acc[label]``."""
    saved = []
    for label, where, name in targets:
        module, cls = where.split(":")
        owner = getattr(importlib.import_module(module), cls)
        fn = owner.__dict__[name]

        def timed_fn(*a, _fn=fn, _label=label, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc[_label] = acc.get(_label, 0.0) + time.perf_counter() - t

        saved.append((owner, name, fn))
        setattr(owner, name, timed_fn)
    try:
        yield acc
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def budget(args, algo: AlgoConfig) -> None:
    """Microseconds per decision step (one step of all envs) of each part, reference and dvla sync."""
    ref: dict[str, float] = {}
    steps = args.updates * args.t_len * args.n_envs  # no episode of these tasks ends before T
    with timed(BUDGET[:1], ref):
        ref["total"] = steps / reference_ppo(args.gym_id, args.n_envs, args.t_len, args.updates, algo, seed=0,
                                             times=ref)
    ref["rest of rollout"] = ref.pop("rollout") - ref["simulator"]
    ours: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, timed(BUDGET, ours):
        ours["total"] = steps / dvla_job(args, Path(tmp) / "budget", "sync")  # the run's wall time
    ours["env wrapper"] -= ours["simulator"]
    ours["rest"] = ours["total"] - sum(v for k, v in ours.items() if k != "total")
    decisions = args.updates * args.t_len
    print(f"microseconds per decision step ({args.gym_id}, {args.n_envs} envs, {args.updates} updates of "
          f"T={args.t_len}):")
    for name, part in (("reference", ref), ("dvla sync", ours)):
        print(f"  {name:10s} " + ", ".join(f"{k} {1e6 * v / decisions:.0f}" for k, v in part.items() if k != "total")
              + f"; total {1e6 * part['total'] / decisions:.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gym-id", default="Pendulum-v1")
    p.add_argument("--n-envs", type=int, default=16)
    p.add_argument("--t-len", type=int, default=64)
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window-s", type=float, default=1.0, help="autotune's measuring window")
    p.add_argument("--settings", default="sync,async,turns,autotune,procs,procs_autotune",
                   help="which dvla settings to run")
    p.add_argument("--budget", action="store_true", help="time the parts of a decision step instead")
    args = p.parse_args()
    torch.set_num_threads(1)
    algo = AlgoConfig(name="ppo", update_epochs=args.epochs, minibatches=args.minibatches)
    if args.budget:
        budget(args, algo)
        return
    names = ["reference", *args.settings.split(",")]
    got: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names[1:]}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            order = names[i % len(names):] + names[: i % len(names)]
            sps = {}
            for name in order:
                if name == "reference":
                    sps[name] = reference_ppo(args.gym_id, args.n_envs, args.t_len, args.updates, algo, seed=i)
                else:
                    sps[name] = dvla_job(args, Path(tmp) / f"{name}{i}", name)
                torch.set_num_threads(1)
            for name in names:
                got[name].append(sps[name])
            for name in names[1:]:
                ratios[name].append(sps[name] / sps["reference"])
            print(f"repeat {i}: " + ", ".join(f"{n} {sps[n]:.0f}" for n in names) + " env steps/s; vs reference "
                  + ", ".join(f"{n} {sps[n] / sps['reference']:.2f}x" for n in names[1:]), flush=True)
    print(f"median ({args.gym_id}, {args.n_envs} envs, T={args.t_len}): "
          + ", ".join(f"{n} {statistics.median(got[n]):.0f}" for n in names) + " env steps/s; vs reference "
          + ", ".join(f"{n} {statistics.median(ratios[n]):.2f}x" for n in names[1:])
          + " (targets: sync >= 0.9x, autotuned >= 1.0x)")


if __name__ == "__main__":
    main()
