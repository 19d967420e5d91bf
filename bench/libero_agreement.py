"""Per-episode agreement of ``dvla eval`` with an evaluation loop written on LIBERO's own API.

    python bench/libero_agreement.py runs/recipe_cpu/sft/latest --tasks 0,1 --episodes 50 --workers 2 \\
        --out bench/libero_agreement.txt

1. ``dvla eval RUN --suite SUITE --tasks T --episodes N --workers W`` (the command itself, in
   this process), with ``LiberoEnv``'s resets and steps watched: each episode's task, initial
   state, first observation and outcome. Its wall time is the command's.
2. The loop, as openpi's and OpenVLA's LIBERO evaluation scripts run it, on LIBERO's API alone:
   one ``OffScreenRenderEnv(bddl_file_name, camera sizes)`` per task (LIBERO's defaults: a hard
   reset, the model reloaded, at every ``reset``) and for each of the first N fixed states
   ``env.seed(...)``, ``env.reset()``, ``env.set_init_state(state)``, 10 steps of the no-op
   action (gripper open), then the policy's most likely chunks, each action stepped in turn,
   until ``env.check_success()`` or the evaluation length in whole chunks (libero_spatial: 220
   actions, 28 chunks of 8 = 224; dvla eval's). The policy sees the agent-view image rotated
   180 degrees (and the wrist image with a run that reads one) and the state openpi gives:
   effector position, its orientation as an axis-angle, the two finger positions; one episode
   at a time. Only the frames a policy reads are rendered (a chunk's last step and the last
   settle step: the camera's sensor, swapped through robosuite's ``modify_observable``, skips
   the others; a frame is rendered at the substep robosuite samples it, so the frames are those
   of a loop that renders every step). The fixtures are drawn as dvla draws them: the reset
   before fixed state k of task t is seeded ``[seed, t, k]`` (``env.seed`` is numpy's global
   seed). Its episodes run in ``--procs`` processes.
3. Per episode: whether the first observation (after the settle steps) is bitwise the same
   (image and state) and whether the outcomes agree; totals, wall times and the load average.

``--reuse-loop FILE.json`` takes the loop's episodes from an earlier output (to score another
dvla eval, e.g. of other code, against the same loop); ``--loop-only`` skips dvla eval.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SETTLE = 10
NOOP = np.array([0.0] * 6 + [-1.0])  # the scripts' dummy action: no motion, gripper open


def _axis_angle(quat: np.ndarray) -> np.ndarray:
    """Axis-angle of a unit quaternion (x, y, z, w): the orientation in openpi's LIBERO state."""
    w = float(np.clip(quat[3], -1.0, 1.0))
    s = np.sqrt(1.0 - w * w)
    if s < 1e-8:
        return np.zeros(3)
    return quat[:3] * (2.0 * np.arccos(w) / s)


def _digest(image: np.ndarray) -> str:
    """An image (H, W, 3) uint8, upright, as a digest (the outputs stay small)."""
    return hashlib.sha1(np.ascontiguousarray(image, np.uint8).tobytes()).hexdigest()


# -- 1. dvla eval, watched ---------------------------------------------------------------------
def run_dvla_eval(run: str, suite: str, tasks: list[int], episodes: int, workers: int, seed: int) -> tuple[list, float]:
    """``dvla eval`` in this process; every episode's task, state, first observation and outcome."""
    from dvla.app.cli import main as dvla
    from dvla.envs.libero_env import LiberoEnv

    episodes_seen, live = [], {}
    names = ("_start_states", "reset", "step")
    orig = {name: getattr(LiberoEnv, name) for name in names}
    own = {name: name in vars(LiberoEnv) for name in names}

    def start_states(self, envs, group_size):
        chosen = orig["_start_states"](self, envs, group_size)
        self._watch_states = chosen
        return chosen

    def reset(self, *a, **kw):
        obs = orig["reset"](self, *a, **kw)
        live.clear()
        for i, k in self._watch_states.items():
            ep = {"task": self.task_of[i], "state": k, "success": False, "decisions": 0,
                  "image": _digest(obs.image[i].permute(1, 2, 0).numpy()), "proprio": obs.proprio[i].numpy().copy()}
            episodes_seen.append(ep)
            live[i] = ep
        return obs

    def step(self, actions):
        res = orig["step"](self, actions)
        for i, ep in live.items():
            if not ep["success"]:
                ep["decisions"] += 1
                ep["success"] = bool(res.success[i])
        return res

    args = ["eval", run, "--suite", suite, "--tasks", ",".join(map(str, tasks)), "--episodes", str(episodes),
            "--workers", str(workers), "--seed", str(seed), "--out", os.path.join(tempfile.mkdtemp(), "eval.json")]
    for name, fn in (("_start_states", start_states), ("reset", reset), ("step", step)):
        setattr(LiberoEnv, name, fn)
    try:
        t0 = time.perf_counter()
        rc = dvla(args)
        wall = time.perf_counter() - t0
    finally:
        for name, fn in orig.items():
            setattr(LiberoEnv, name, fn) if own[name] else delattr(LiberoEnv, name)
    if rc != 0:
        raise SystemExit(f"dvla {' '.join(args)}: exit status {rc}")
    by_key = {}
    for ep in episodes_seen:  # the last batch may run states past the count: keep the first N
        by_key.setdefault((ep["task"], ep["state"]), ep)
    return [by_key[(t, k)] for t in tasks for k in range(episodes)], wall


# -- 2. the loop on LIBERO's API ---------------------------------------------------------------
class _FramesOnDemand:
    """A camera sensor that renders only when ``on``, and otherwise hands back the last frame."""

    def __init__(self, sensor):
        self.sensor, self.on, self.frame = sensor, True, None
        self.__modality__ = sensor.__modality__

    def __call__(self, cache):
        if self.on or self.frame is None:
            self.frame = self.sensor(cache)
        return self.frame


def _loop_worker(job: dict) -> list[dict]:
    os.environ.setdefault("MUJOCO_GL", "egl")
    os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
    import torch

    torch.set_num_threads(1)
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs import OffScreenRenderEnv

    from dvla.evaluation import load_policy  # the run's policy and weights, as dvla eval loads them
    from dvla.types import Observation

    cfg, policy, _ = load_policy(Path(job["run"]))
    size, wrist = cfg.env.image_size, int(cfg.env.options.get("wrist_size", 0) or 0)
    k_chunk = cfg.policy.action_chunk
    suite = benchmark.get_benchmark(job["suite"])(task_order_index=0)
    out = []
    for task in sorted({t for t, _ in job["episodes"]}):
        spec = suite.get_task(task)
        bddl = os.path.join(get_libero_path("bddl_files"), spec.problem_folder, spec.bddl_file)
        states = suite.get_task_init_states(task)
        names, sizes = (["agentview", "robot0_eye_in_hand"], [size, wrist]) if wrist else (["agentview"], [size])
        env = OffScreenRenderEnv(bddl_file_name=bddl, camera_names=names, camera_heights=sizes, camera_widths=sizes)
        instruction = spec.language
        for _, k in [e for e in job["episodes"] if e[0] == task]:
            t0 = time.perf_counter()
            env.seed([job["seed"] % 2**32, task, k])  # numpy's global seed: the reset's draws (the fixtures)
            env.reset()
            cams = []  # a hard reset rebuilt the sensors
            for n in names:
                cam = _FramesOnDemand(env.env._observables[f"{n}_image"]._sensor)
                env.env.modify_observable(f"{n}_image", "sensor", cam)
                cams.append(cam)

            def frames(on):
                for c in cams:
                    c.on = on

            frames(False)
            obs = env.set_init_state(states[k])
            for i in range(SETTLE):
                frames(i == SETTLE - 1)
                obs, _, _, _ = env.step(NOOP)
            first = None
            success, steps, decisions = False, 0, job["decisions"]
            for d in range(decisions):
                image = np.ascontiguousarray(obs["agentview_image"][::-1, ::-1])
                proprio = np.concatenate([obs["robot0_eef_pos"], _axis_angle(obs["robot0_eef_quat"]),
                                          obs["robot0_gripper_qpos"]]).astype(np.float32)
                if first is None:
                    first = (_digest(image), proprio.copy())
                cameras = {}
                if wrist:
                    w = np.ascontiguousarray(obs["robot0_eye_in_hand_image"][::-1, ::-1])
                    cameras["wrist"] = torch.from_numpy(w).permute(2, 0, 1)[None]
                o = Observation(image=torch.from_numpy(image).permute(2, 0, 1)[None], proprio=torch.from_numpy(proprio)[None],
                                instruction=[instruction], cameras=cameras)
                with torch.no_grad():
                    actions = policy.act(policy.prepare(o), True, None).actions[0].clamp(-1.0, 1.0)
                actions = actions.to(torch.float64).numpy()
                for a in range(k_chunk):
                    frames(a == k_chunk - 1)
                    obs, _, _, _ = env.step(actions[a])
                    steps += 1
                    if env.check_success():
                        success = True
                        break
                if success:
                    break
            out.append({"task": task, "state": k, "success": success, "steps": steps, "decisions": d + 1,
                        "image": first[0], "proprio": first[1], "seconds": time.perf_counter() - t0})
        env.close()
    return out


def run_loop(run: str, suite: str, tasks: list[int], episodes: int, seed: int, decisions: int,
             procs: int) -> tuple[list, float]:
    todo = [(t, k) for t in tasks for k in range(episodes)]
    jobs = [{"run": run, "suite": suite, "seed": seed, "decisions": decisions, "episodes": todo[p::procs]}
            for p in range(procs)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(procs) as pool:
        parts = pool.map(_loop_worker, jobs)
    wall = time.perf_counter() - t0
    by_key = {(e["task"], e["state"]): e for part in parts for e in part}
    return [by_key[key] for key in todo], wall


# -- 3. agreement ------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run")
    p.add_argument("--suite", default="libero_spatial")
    p.add_argument("--tasks", default="0,1")
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--workers", type=int, default=2, help="dvla eval's --workers")
    p.add_argument("--procs", type=int, default=2, help="the loop's processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/libero_agreement.txt", help="the summary; FILE.json: every episode")
    p.add_argument("--reuse-loop", help="the loop's episodes from an earlier FILE.json")
    p.add_argument("--loop-only", action="store_true")
    args = p.parse_args()
    tasks = [int(t) for t in args.tasks.split(",")]
    from dvla.envs.libero_env import EVAL_STEPS
    from dvla.evaluation import load_policy

    k = load_policy(Path(args.run))[0].policy.action_chunk
    decisions = -(-EVAL_STEPS[args.suite] // k)
    lines, record = [], {"run": args.run, "suite": args.suite, "tasks": tasks, "episodes": args.episodes,
                         "seed": args.seed, "decisions": decisions, "action_chunk": k}

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    say(f"# {' '.join(['python', 'bench/libero_agreement.py', *sys.argv[1:]])}")
    say(f"run {args.run}; {args.suite} tasks {tasks}, fixed states 0..{args.episodes - 1}; "
        f"{decisions} chunks of {k} actions; {os.cpu_count()} CPUs")
    dv = None
    if not args.loop_only:
        load0 = os.getloadavg()
        dv, dv_wall = run_dvla_eval(args.run, args.suite, tasks, args.episodes, args.workers, args.seed)
        record["dvla"] = {"wall_s": dv_wall, "load_before": load0, "load_after": os.getloadavg()}
        say(f"dvla eval --workers {args.workers}: {sum(e['success'] for e in dv)}/{len(dv)} in {dv_wall:.0f} s "
            f"(load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f})")
    if args.reuse_loop:
        old = json.loads(Path(args.reuse_loop).read_text())
        loop = [{**e, "proprio": np.array(e["proprio"], np.float32)} for e in old["loop_episodes"]]
        record["loop"] = {**old["loop"], "reused_from": args.reuse_loop}
        say(f"loop (from {args.reuse_loop}): {sum(e['success'] for e in loop)}/{len(loop)}")
    else:
        load0 = os.getloadavg()
        loop, loop_wall = run_loop(args.run, args.suite, tasks, args.episodes, args.seed, decisions, args.procs)
        record["loop"] = {"wall_s": loop_wall, "procs": args.procs, "load_before": load0, "load_after": os.getloadavg()}
        say(f"loop on LIBERO's API, {args.procs} processes: {sum(e['success'] for e in loop)}/{len(loop)} in "
            f"{loop_wall:.0f} s (load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f})")
    record["loop_episodes"] = [{**e, "proprio": e["proprio"].tolist()} for e in loop]
    if dv is not None:
        same_obs = agree = 0
        say("")
        say("task state  first-obs  dvla loop  agree  (first obs: image and state bitwise; max |state diff|)")
        rows = []
        for a, b in zip(dv, loop):
            same = bool(a["image"] == b["image"] and np.array_equal(a["proprio"], b["proprio"]))
            diff = float(np.abs(a["proprio"].astype(np.float64) - b["proprio"]).max())
            ok = a["success"] == b["success"]
            same_obs += same
            agree += ok
            rows.append({"task": a["task"], "state": a["state"], "first_obs_same": same, "state_diff": diff,
                         "dvla": a["success"], "loop": b["success"], "agree": ok})
            say(f"{a['task']:4d} {a['state']:5d}  {'same' if same else 'DIFF':9s}  {int(a['success']):4d} "
                f"{int(b['success']):4d}  {'yes' if ok else 'NO':5s}  {diff:.2g}")
        record["per_episode"] = rows
        record["totals"] = {"first_obs_same": same_obs, "outcomes_agree": agree, "episodes": len(rows),
                            "dvla_successes": sum(e["success"] for e in dv),
                            "loop_successes": sum(e["success"] for e in loop)}
        say("")
        say(f"first observation bitwise the same: {same_obs}/{len(rows)}; outcomes agree: {agree}/{len(rows)}; "
            f"successes: dvla {record['totals']['dvla_successes']}, loop {record['totals']['loop_successes']}")
    out = Path(args.out)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
