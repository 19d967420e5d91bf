"""``dvla sft``: supervised warm start of any policy on a demonstration dataset.

    dvla sft --data DATASET [--preset P] [--config F.yaml] [--out BASE] [--resume] [KEY=VALUE ...]
    torchrun --standalone --nproc_per_node=N -m dvla.launch sft --data DATASET [...]

The policy (``policy.*``) is built for the preset's env (``env.*``: only its spec is needed,
no simulator) and trained with its own imitation loss
(:meth:`dvla.policy.VLAPolicy.imitation_loss`: the chunk's negative log-likelihood for
Gaussian, binned and token heads, flow matching for flow heads) on global minibatches of
``--batch-size`` random frames: each frame's observation and the chunk of
``policy.action_chunk`` actions from it (steps past the episode's end masked). Proprio and
actions are normalised with the dataset's statistics (:mod:`dvla.normalize`;
``--action-norm none`` leaves actions as they are). ``run.iterations`` optimizer steps of
AdamW (``algo.lr``, ``algo.weight_decay``, ``algo.lr_schedule`` / ``lr_warmup`` /
``lr_horizon``, ``algo.max_grad_norm``, ``algo.precision``), seeded with ``run.seed``.

Under torchrun (``-m dvla.launch sft`` or ``-m dvla.cli sft``) every rank is a learner
(``swimlane.learner_ranks`` is the world size): the process group is the RL launcher's (gloo
on the CPU, NCCL and one GPU per rank on CUDA), every rank draws the same global minibatch
(from ``run.seed``: the same batches whatever the number of ranks) and trains on its own
share of it, and the gradients are averaged (:mod:`dvla.algos.imitation`: a step equals the
one-process step on the whole batch). ``algo.shard`` shards the model as it shards RL
learners: ``auto`` (the default) and ``fsdp`` with FSDP2 over the ranks
(:func:`dvla.distributed.sharding.shard_learner`), ``none`` replicates it and all-reduces the gradients.

Like an RL run it writes its own run directory under ``--out`` (default
``{run.out_dir}-sft``; ``BASE/latest`` points to it), from rank 0 only: ``config.yaml``,
``metrics.jsonl`` (``loss``, the head's stats, ``lr``, ``grad_norm``, ``frames_per_s``),
``weights.safetensors`` (the whole model, with the policy's name, the version = steps done and
the normalisation), ``normalization.json``, ``summary.json`` and ``checkpoints/``: every
``run.save_every`` steps and at the end, the model, the optimizer's state, the step and every
rank's random generators (:mod:`dvla.app.sft.checkpoints`). ``--resume`` (or ``run.resume=true``)
continues the latest run from its newest valid checkpoint, exactly as if it had not stopped
(with more ``run.iterations`` it trains on). The console shows a progress bar, or with
``run.progress=false`` one line per metrics row, and a line with the loss, frames/s and the
time left every tenth of the run. Start RL from the run with ``policy.init=RUN_DIR``;
``dvla eval RUN_DIR`` scores it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from dvla.app.run import EXIT_USER_ERROR, fail, leave, local_rank, restarts, say_error, see_own_gpu, share_run_dir
from dvla.config import ConfigError
from dvla.datasets.frames import Frames, GlobalBatches, load_frames, shard

PROG = "dvla sft"  # the prefix of its error lines

__all__ = ["Job", "main", "train_sft"]


@dataclasses.dataclass
class Job:
    data: str
    batch_size: int = 64
    action_norm: str = "bounds"
    preset: str = "fast_reach"
    episodes_per_task: int | None = None


def train_sft(cfg, job: Job, frames: Frames, norm, run_dir: Path, resumed: bool, rank: int = 0, world: int = 1,
              log=print) -> dict:
    """Train ``cfg``'s policy on ``frames`` into ``run_dir`` (written by rank 0) on this rank of
    ``world``; continues the run's newest checkpoint where ``resumed``. The summary."""
    from dvla.algos.imitation import device_of
    from memory import runtime

    # (on CUDA: the device runtime every CUDA call goes through, the process's while it trains)
    with runtime.serving(device_of(cfg, world)) as rt:
        rt.bind_thread()
        return _train_sft(cfg, job, frames, norm, run_dir, resumed, rank, world, log)


def _train_sft(cfg, job: Job, frames: Frames, norm, run_dir: Path, resumed: bool, rank: int, world: int, log) -> dict:
    from dvla.state.checkpoint import save_weights
    from dvla.config import dump_yaml
    from dvla.envs import env_spec
    from dvla.state.init_weights import WEIGHTS_FILE
    from dvla.metrics import MetricsLogger
    from dvla.normalize import FILE as NORM_FILE, METADATA_KEY
    from dvla.policy import PolicySpec, build_policy
    from dvla.algos.imitation import ImitationLearner, device_of, sharded
    from dvla.app.sft.checkpoints import RANK_SEED, SFTCheckpoints, sft_check
    from dvla.metrics import truncate_metrics
    from dvla.distributed.sharding import full_state_dict

    lead = rank == 0
    device = device_of(cfg, world)
    torch.manual_seed(cfg.run.seed)  # the same weights on every rank
    steps, k, size = cfg.run.iterations, cfg.policy.action_chunk, job.batch_size
    policy = build_policy(cfg.policy.name, PolicySpec.for_env(env_spec(cfg.env), k), cfg.policy.options)
    policy = policy.to(device).train()
    policy.normalizer = norm
    learner = ImitationLearner(cfg.algo, policy, world, horizon=steps)
    ckpts = SFTCheckpoints(run_dir / "checkpoints", cfg.run.keep_checkpoints, rank, world, log)
    norm_json = norm.to_json()
    start = ckpts.resume(learner, sft_check(size, job.action_norm, len(frames), norm_json), cfg.run.seed) \
        if resumed else 0
    if start == 0 and rank:
        torch.manual_seed(cfg.run.seed + RANK_SEED * rank)  # each rank's own noise
    shards = "fsdp" if sharded(cfg, world) else "none"
    learner.prepare(shards == "fsdp", cfg.policy.name)
    meta = {METADATA_KEY: norm_json, "sft_data": str(job.data)}
    manifest = {"config": cfg.to_dict(), METADATA_KEY: norm_json,
                "sft": {"data": str(job.data), "batch_size": size, "action_norm": job.action_norm,
                        "episodes_per_task": job.episodes_per_task,
                        "frames": len(frames), "episodes": frames.episodes, "world_size": world, "shard": shards}}
    if lead:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_yaml(cfg, run_dir / "config.yaml")
        norm.save(run_dir / NORM_FILE)
        truncate_metrics(run_dir / "metrics.jsonl", start)

    every = max(1, steps // 100)  # about 100 rows of metrics
    tick = max(1, steps // 10)  # a progress line every tenth of the run
    metrics = MetricsLogger(run_dir, total=math.ceil(steps / every), enabled=lead, progress=cfg.run.progress,
                            initial=start // every, tensorboard=cfg.run.tensorboard)
    if lead:
        log(f"dvla sft: {cfg.policy.name} on {job.data}: {frames.episodes} episodes, {len(frames)} frames, "
            f"{steps} steps of {size} on {world} rank(s){' (FSDP)' if shards == 'fsdp' else ''}"
            f"{f', from step {start}' if start else ''}, into {run_dir}")
    batches = GlobalBatches(len(frames), size, cfg.run.seed)
    batches.skip(start)
    acc: dict[str, float] = {}
    n_acc = 0
    t0 = last = time.perf_counter()
    first_loss = final_loss = float("nan")
    try:
        for step in range(start, steps):
            idx = batches.next()
            mine = shard(idx, rank, world)
            obs, chunks, valid = frames.batch(mine)
            share = frames.valid_steps(mine) / max(frames.valid_steps(idx), 1)
            out = learner.imitation_step(obs, chunks.to(device), valid.to(device), share, step)
            final_loss = out["loss"]
            first_loss = final_loss if step == start else first_loss
            for name, v in out.items():
                if name != "lr":
                    acc[name] = acc.get(name, 0.0) + float(v)
            n_acc += 1
            done = step + 1
            if done % every == 0 or done == steps:
                now = time.perf_counter()
                metrics.log(step, {**{k_: v / n_acc for k_, v in acc.items()}, "lr": out["lr"],
                                   "frames_per_s": n_acc * len(idx) / max(now - last, 1e-9), "version": done})
                acc, n_acc, last = {}, 0, now
            if lead and (done % tick == 0 or done == steps):
                spent = time.perf_counter() - t0
                rate = (done - start) / max(spent, 1e-9)
                log(f"dvla sft: step {done}/{steps}: loss {final_loss:.4f}, {rate * len(idx):.0f} frames/s, "
                    f"eta {(steps - done) / rate:.0f} s")
            if (cfg.run.save_every and done % cfg.run.save_every == 0) or done == steps:
                ckpts.save(done, learner, manifest)
    finally:
        metrics.close()
    state = full_state_dict(learner.policy)  # (gathered from the shards: every rank)
    if lead:
        save_weights(learner.policy, run_dir / WEIGHTS_FILE, steps, state=state, **meta)
    summary = {"kind": "sft", "steps": steps, "batch_size": size, "data": str(job.data),
               "episodes": frames.episodes, "frames": len(frames), "first_loss": first_loss,
               "final_loss": final_loss, "wall_s": round(time.perf_counter() - t0, 3),
               "action_norm": job.action_norm, "policy": cfg.policy.name, "world_size": world, "shard": shards,
               "resumed_from": start or None}
    if lead:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def parse(argv: list[str], world: int) -> tuple[object, Job, Path]:
    """``(cfg, job, base directory)`` from the command line; a ConfigError for any mistake."""
    from dvla.envs import check_env_config
    from dvla.policy import policy_config
    from dvla.config.presets import PRESETS, compose
    from memory import runtime

    p = argparse.ArgumentParser(prog="dvla sft", description="Supervised warm start: train a policy on a "
                                "demonstration dataset with its imitation loss; writes a run directory that "
                                "policy.init and dvla eval take. KEY=VALUE overrides as for dvla train "
                                "(run.iterations: optimizer steps). Several ranks: torchrun ... -m dvla.launch sft.")
    p.add_argument("--data", required=True, help="a LeRobot dataset directory or LIBERO HDF5 demonstrations")
    p.add_argument("--preset", default="fast_reach", help=f"one of: {', '.join(PRESETS)} (default: %(default)s)")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file applied on top of the preset")
    p.add_argument("--out", help="base directory of the run (default: run.out_dir where it is overridden, "
                                 "else the preset's run.out_dir + '-sft')")
    p.add_argument("--batch-size", type=int, default=64, help="frames per optimizer step, over all ranks "
                                                               "(default: %(default)s)")
    p.add_argument("--action-norm", choices=("bounds", "none"), default="bounds",
                   help="actions: the data's [q01, q99] onto [-1, 1] (bounds, default) or as they are (none)")
    p.add_argument("--episodes-per-task", type=int, help="train on each task's (instruction's) first N episodes "
                   "only, normalised with their statistics (default: every episode)")
    p.add_argument("--resume", action="store_true", help="continue the latest run under the base directory "
                   "from its newest valid checkpoint (same as run.resume=true)")
    a, rest = p.parse_known_args(argv)
    bad = [x for x in rest if "=" not in x]
    if bad:
        raise ConfigError(f"unrecognised argument(s) {' '.join(bad)} (dvla sft --help)")
    if a.batch_size < world:
        raise ConfigError(f"--batch-size must be at least the number of ranks ({world}), got {a.batch_size}")
    cfg = compose(a.preset, a.config, rest, a.resume)
    if cfg.algo.shard == "fsdp" and world < 2:
        raise ConfigError("algo.shard=fsdp shards the model over the ranks of the job: run dvla sft under torchrun "
                          "with 2 or more processes, or set algo.shard=none")
    cfg.swimlane.learner_ranks = world  # every rank of an SFT job learns
    cfg.validate()
    if cfg.run.device.startswith("cuda") and not runtime.current().available():
        raise ConfigError(f"run.device={cfg.run.device!r} but CUDA is not available on this machine (run.device=auto "
                          "uses a GPU where there is one, else the CPU)")
    check_env_config(cfg.env)
    policy_config(cfg.policy.name, cfg.policy.options)
    overridden = any(x.startswith(("run.out_dir=", "--run.out_dir=")) for x in rest)
    base = a.out or (cfg.run.out_dir if overridden or a.config else f"{cfg.run.out_dir.rstrip('/')}-sft")
    if not Path(a.data).exists():
        raise ConfigError(f"--data: {a.data} does not exist")
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=str(base)))
    if a.episodes_per_task is not None and a.episodes_per_task < 1:
        raise ConfigError(f"--episodes-per-task: at least 1, got {a.episodes_per_task}")
    return cfg, Job(a.data, a.batch_size, a.action_norm, a.preset, a.episodes_per_task), Path(base)


def load_data(cfg, job: Job, world: int):
    """``(frames, normalisation)`` of ``--data``, checked against the env (a DatasetError)."""
    from dvla.datasets import open_dataset
    from dvla.envs import env_spec
    from dvla.normalize import Normalizer

    reader = open_dataset(job.data, spec=env_spec(cfg.env))
    frames = load_frames(reader, cfg.policy.action_chunk, job.episodes_per_task)
    if min(job.batch_size, len(frames)) < world:
        raise ConfigError(f"--data: {len(frames)} frames cannot give each of {world} ranks a share of a batch")
    if job.episodes_per_task is None:
        stats = reader.stats()
    else:  # the statistics of the episodes trained on, not of the whole dataset
        from dvla.datasets.stats import dvla_stats

        stats = dvla_stats(frames.actions, frames.proprio)
    return frames, Normalizer.from_stats(stats, job.action_norm)


def main(argv: list[str]) -> int:
    """``dvla sft``; under torchrun every rank of the job runs it (``-m dvla.launch sft``), around
    it what every training application does on a rank (:mod:`dvla.app.run`)."""
    from dvla.algos.imitation import device_of
    from dvla.datasets import DatasetError
    from memory import runtime

    user_errors = (ConfigError, DatasetError, ValueError, FloatingPointError, NotImplementedError)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1) if "RANK" in os.environ else 1
    try:  # the same on every rank: each host's first rank says what went wrong
        see_own_gpu()  # first: nothing may start CUDA before
        cfg, job, base = parse(argv, world)
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        frames, norm = load_data(cfg, job, world)
        device = device_of(cfg, world)
    except user_errors as exc:
        if local_rank() == 0:
            say_error(PROG, exc)
        return EXIT_USER_ERROR
    with runtime.serving(device):  # the rank's device runtime, its whole life (memory/runtime.py)
        return _rank(cfg, job, base, frames, norm, world, user_errors)


def _rank(cfg, job: Job, base: Path, frames: Frames, norm, world: int, user_errors) -> int:
    from dvla.distributed import init_from_env
    from dvla.logs import setup_logging

    rank, world = init_from_env(timeout_s=cfg.swimlane.collective_timeout_s, device=cfg.run.device,
                                collective_backend=cfg.swimlane.collective_backend)
    setup_logging(rank)  # (dvla's own log lines: damaged checkpoints skipped, what a resume changes)
    progress_bar = cfg.run.progress and rank == 0

    def log(line: str) -> None:
        if progress_bar:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    run = None
    try:
        run = share_run_dir(base, cfg, rank, world, restarts(), unit="steps")
        summary = train_sft(cfg, job, frames, norm, run.path, run.resumed, rank, world, log)
    except BaseException as exc:
        return fail(PROG, exc, rank=rank, world=world, run=run, kinds=user_errors)
    if rank == 0:
        resumed_from = f" (resumed from step {summary['resumed_from']})" if summary["resumed_from"] else ""
        print(f"done: {summary['steps']} steps{resumed_from} in {summary['wall_s']:.1f} s, loss "
              f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}\noutputs: {run.path}  (metrics.jsonl, "
              f"summary.json, weights.safetensors, normalization.json, checkpoints/)\nnext:    dvla eval {run.path}"
              f"   |   dvla train --preset {job.preset} policy.init={run.path}", flush=True)
    return leave(world)
