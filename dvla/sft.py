"""``dvla sft``: supervised warm start of any policy on a demonstration dataset.

    dvla sft --data DATASET [--preset P] [--config F.yaml] [--out BASE] [KEY=VALUE ...]

The policy (``policy.*``) is built for the preset's env (``env.*``: only its spec is needed,
no simulator) and trained with its own imitation loss
(:meth:`dvla.policy.VLAPolicy.imitation_loss`: the chunk's negative log-likelihood for
Gaussian, binned and token heads, flow matching for flow heads) on minibatches of
``--batch-size`` random frames: each frame's observation and the chunk of
``policy.action_chunk`` actions from it (steps past the episode's end masked). Proprio and
actions are normalised with the dataset's statistics (:mod:`dvla.normalize`;
``--action-norm none`` leaves actions as they are). ``run.iterations`` optimizer steps of
AdamW (``algo.lr``, ``algo.weight_decay``, ``algo.lr_schedule`` / ``lr_warmup`` /
``lr_horizon``, ``algo.max_grad_norm``), seeded with ``run.seed``.

Like an RL run it writes its own run directory under ``--out`` (default
``{run.out_dir}-sft``; ``BASE/latest`` points to it): ``config.yaml``, ``metrics.jsonl``
(``loss``, the head's stats, ``lr``, ``grad_norm``, ``frames_per_s``), ``weights.safetensors``
(with the policy's name, the version = steps done and the normalisation; also every
``run.save_every`` steps), ``normalization.json`` and ``summary.json``. Start RL from it
with ``policy.init=RUN_DIR``; ``dvla eval RUN_DIR`` scores it. Single process for now.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dvla.config import ConfigError, apply_overrides, load_yaml
from dvla.types import MAIN_CAMERA, Observation


@dataclass
class Frames:
    """Every frame of a dataset in memory (storage form), with its action chunk."""

    images: dict[str, np.ndarray]  # camera -> (N, H, W, 3) uint8
    proprio: np.ndarray  # (N, P) float32
    chunks: torch.Tensor  # (N, K, D)
    valid: torch.Tensor  # (N, K) bool
    instructions: list[str]  # (N,)
    episodes: int

    def __len__(self) -> int:
        return len(self.proprio)

    def batch(self, idx: np.ndarray) -> tuple[Observation, torch.Tensor, torch.Tensor]:
        def chw(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a[idx]).permute(0, 3, 1, 2).contiguous()

        obs = Observation(image=chw(self.images[MAIN_CAMERA]), proprio=torch.from_numpy(self.proprio[idx]),
                          instruction=[self.instructions[i] for i in idx],
                          cameras={k: chw(v) for k, v in self.images.items() if k != MAIN_CAMERA})
        t = torch.from_numpy(idx)
        return obs, self.chunks[t], self.valid[t]


def load_frames(reader, k: int) -> Frames:
    images: dict[str, list] = {}
    proprio, chunks, valid, instr = [], [], [], []
    for ep in reader:
        for cam, a in ep.images.items():
            images.setdefault(cam, []).append(a)
        proprio.append(ep.proprio.astype(np.float32))
        c, v = ep.action_chunks(k)
        chunks.append(c)
        valid.append(v)
        instr += [ep.instruction] * len(ep)
    if not proprio:
        raise ConfigError("--data: the dataset holds no episodes")
    return Frames({cam: np.concatenate(a) for cam, a in images.items()}, np.concatenate(proprio),
                  torch.cat(chunks), torch.cat(valid), instr, len(proprio))


def _device(cfg) -> torch.device:
    from memory import runtime

    if cfg.run.device == "auto":
        return torch.device("cuda" if runtime.current().available() else "cpu")
    if cfg.run.device.startswith("cuda") and not runtime.current().available():
        raise ConfigError(f"run.device={cfg.run.device!r} but CUDA is not available on this machine")
    return torch.device(cfg.run.device)


def train_sft(cfg, data: str | Path, run_dir: Path, batch_size: int = 64, action_norm: str = "bounds",
              log=print) -> dict:
    """Train ``cfg``'s policy on the dataset ``data`` into ``run_dir``; the summary."""
    from dvla.algos.guards import lr_factor
    from dvla.algos.optim import param_groups
    from dvla.checkpoint import save_weights
    from dvla.config import dump_yaml
    from dvla.datasets import open_dataset
    from dvla.envs import env_spec
    from dvla.init_weights import WEIGHTS_FILE
    from dvla.metrics import MetricsLogger
    from dvla.normalize import FILE as NORM_FILE, METADATA_KEY, Normalizer
    from dvla.policy import PolicySpec, build_policy

    torch.manual_seed(cfg.run.seed)
    espec = env_spec(cfg.env)
    reader = open_dataset(data, spec=espec)  # a DatasetError where it does not fit the env
    k = cfg.policy.action_chunk
    frames = load_frames(reader, k)
    norm = Normalizer.from_stats(reader.stats(), action_norm)
    device = _device(cfg)
    policy = build_policy(cfg.policy.name, PolicySpec.for_env(espec, k), cfg.policy.options).to(device).train()
    policy.normalizer = norm
    groups = param_groups(policy)
    for g in groups:
        g.setdefault("lr", cfg.algo.lr)
        g["base_lr"] = g["lr"]
    opt = torch.optim.AdamW(groups, lr=cfg.algo.lr, weight_decay=cfg.algo.weight_decay)
    params = [p for g in groups for p in g["params"]]
    steps = cfg.run.iterations
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, run_dir / "config.yaml")
    (run_dir / NORM_FILE).write_text(norm.to_json())
    meta = {METADATA_KEY: norm.to_json(), "sft_data": str(data)}

    def save(version: int) -> None:
        save_weights(policy, run_dir / WEIGHTS_FILE, version, **meta)

    every = max(1, steps // 100)  # about 100 rows of metrics
    metrics = MetricsLogger(run_dir, total=math.ceil(steps / every), progress=cfg.run.progress,
                            tensorboard=cfg.run.tensorboard)
    log(f"dvla sft: {cfg.policy.name} on {data}: {frames.episodes} episodes, {len(frames)} frames, "
        f"{steps} steps of {batch_size}, into {run_dir}")
    rng = np.random.default_rng(cfg.run.seed)
    order, at = rng.permutation(len(frames)), 0
    acc: dict[str, float] = {}
    start = last = time.perf_counter()
    first_loss = final_loss = float("nan")
    try:
        for step in range(steps):
            if at + batch_size > len(order):
                order, at = rng.permutation(len(frames)), 0
            idx = order[at:at + batch_size]
            at += batch_size
            obs, chunks, valid = frames.batch(idx)
            scale = lr_factor(cfg.algo.lr_schedule, step, cfg.algo.lr_horizon or steps, cfg.algo.lr_warmup)
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * scale
            loss, stats = policy.imitation_loss(obs, chunks.to(device), valid.to(device))
            if not torch.isfinite(loss):
                raise FloatingPointError(f"dvla sft: the imitation loss is {float(loss)} at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.algo.max_grad_norm)
            opt.step()
            final_loss = float(loss.detach())
            first_loss = final_loss if step == 0 else first_loss
            for name, v in {"loss": final_loss, **stats, "grad_norm": float(gnorm)}.items():
                acc[name] = acc.get(name, 0.0) + float(v)
            done = step + 1
            if done % every == 0 or done == steps:
                n = done % every or every
                now = time.perf_counter()
                metrics.log(step, {**{k_: v / n for k_, v in acc.items()}, "lr": cfg.algo.lr * scale,
                                   "frames_per_s": n * len(idx) / max(now - last, 1e-9), "version": done})
                acc, last = {}, now
            if cfg.run.save_every and done % cfg.run.save_every == 0 and done < steps:
                save(done)
    finally:
        metrics.close()
    save(steps)
    summary = {"kind": "sft", "steps": steps, "batch_size": batch_size, "data": str(data),
               "episodes": frames.episodes, "frames": len(frames), "first_loss": first_loss,
               "final_loss": final_loss, "wall_s": round(time.perf_counter() - start, 3),
               "action_norm": action_norm, "policy": cfg.policy.name}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str]) -> int:
    from dvla.datasets import DatasetError
    from dvla.envs import check_env_config
    from dvla.policy import policy_config
    from dvla.presets import PRESETS, get_preset
    from dvla.rundir import new_run_dir

    p = argparse.ArgumentParser(prog="dvla sft", description="Supervised warm start: train a policy on a "
                                "demonstration dataset with its imitation loss; writes a run directory that "
                                "policy.init and dvla eval take. KEY=VALUE overrides as for dvla train "
                                "(run.iterations: optimizer steps).")
    p.add_argument("--data", required=True, help="a LeRobot dataset directory or LIBERO HDF5 demonstrations")
    p.add_argument("--preset", default="fast_reach", help=f"one of: {', '.join(PRESETS)} (default: %(default)s)")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file applied on top of the preset")
    p.add_argument("--out", help="base directory of the run (default: run.out_dir where it is overridden, "
                                 "else the preset's run.out_dir + '-sft')")
    p.add_argument("--batch-size", type=int, default=64, help="frames per optimizer step (default: %(default)s)")
    p.add_argument("--action-norm", choices=("bounds", "none"), default="bounds",
                   help="actions: the data's [q01, q99] onto [-1, 1] (bounds, default) or as they are (none)")
    a, rest = p.parse_known_args(argv)
    try:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world > 1:
            raise ConfigError(f"dvla sft runs in one process for now (WORLD_SIZE={world}): run it without torchrun")
        bad = [x for x in rest if "=" not in x]
        if bad:
            raise ConfigError(f"unrecognised argument(s) {' '.join(bad)} (dvla sft --help)")
        if a.batch_size < 1:
            raise ConfigError("--batch-size must be >= 1")
        cfg = get_preset(a.preset)
        if a.config:
            cfg = load_yaml(cfg, a.config)
        cfg = apply_overrides(cfg, rest)
        cfg.validate()
        check_env_config(cfg.env)
        policy_config(cfg.policy.name, cfg.policy.options)
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        overridden = any(x.startswith(("run.out_dir=", "--run.out_dir=")) for x in rest)
        base = a.out or (cfg.run.out_dir if overridden or a.config else f"{cfg.run.out_dir.rstrip('/')}-sft")
        if not Path(a.data).exists():
            raise ConfigError(f"--data: {a.data} does not exist")
        run_dir = new_run_dir(base, cfg.run.name)
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=str(base)))
        summary = train_sft(cfg, a.data, run_dir, a.batch_size, a.action_norm,
                            log=lambda s: print(s, file=sys.stderr, flush=True))
    except (ConfigError, DatasetError, ValueError, FloatingPointError, NotImplementedError) as exc:
        print(f"dvla sft: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"done: {summary['steps']} steps in {summary['wall_s']:.1f} s, loss {summary['first_loss']:.4f} -> "
          f"{summary['final_loss']:.4f}\noutputs: {run_dir}  (metrics.jsonl, summary.json, weights.safetensors, "
          f"normalization.json)\nnext:    dvla eval {run_dir}   |   dvla train --preset {a.preset} "
          f"policy.init={run_dir}")
    return 0
