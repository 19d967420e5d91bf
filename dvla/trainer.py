"""The synchronous trainer: rollout -> learn -> update, one stage after the other.

This is the baseline that the asynchronous swimlane is measured against. With
several ranks (``torchrun --nproc_per_node=N``) each rank collects its own episodes
and gradients are averaged with an all-reduce, so all replicas stay identical.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dvla.algos import build_algorithm
from dvla.checkpoint import save_weights
from dvla.config import JobConfig, dump_yaml
from dvla.distributed import allreduce_mean_grads, mean_over_group, resolve_device
from dvla.envs import make_env
from dvla.metrics import MetricsLogger
from dvla.policy import PolicySpec, build_policy
from dvla.rollout import RolloutTimes, collect_episodes, episode_stats
from dvla.types import RolloutBatch


class SyncTrainer:
    def __init__(self, cfg: JobConfig, rank: int = 0, world_size: int = 1):
        cfg.validate()
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        self.device = resolve_device(cfg.run.device)
        seed = cfg.run.seed
        torch.manual_seed(seed)  # identical initial weights on every rank
        self.env = make_env(cfg.env, self.device, seed=seed + 7919 * rank)
        spec = PolicySpec.for_env(self.env.spec, cfg.policy.action_chunk)
        self.policy = build_policy(cfg.policy.name, spec, cfg.policy.options).to(self.device).eval()
        distributed = world_size > 1
        if distributed:
            for p in self.policy.state_dict().values():
                dist.broadcast(p, src=0)
        self.algo = build_algorithm(cfg.algo, self.policy, allreduce_mean_grads if distributed else None)
        self.sample_gen = torch.Generator(device=self.device).manual_seed(seed + 104729 * rank + 1)
        self.learn_gen = torch.Generator().manual_seed(seed + 2)
        self.version = 0
        self.iteration = 0
        self.out_dir = Path(cfg.run.out_dir)
        self.group_size = cfg.algo.group_size if cfg.algo.name == "grpo" else 1

    def collect(self, times: RolloutTimes) -> RolloutBatch:
        n_groups = self.cfg.env.n_envs // self.group_size
        return collect_episodes(
            self.env,
            self.policy,
            self.cfg.env.episode_len,
            group_size=self.group_size,
            policy_version=self.version,
            group_offset=(self.iteration * self.world_size + self.rank) * n_groups,
            generator=self.sample_gen,
            times=times,
        )

    def evaluate(self, batches: int = 4) -> dict[str, float]:
        """Success rate and return of the current policy over ``batches`` fresh batches of
        episodes (sampled actions, no learning, own random stream)."""
        stats = [episode_stats(self.collect(RolloutTimes())) for _ in range(batches)]
        return {k: sum(s[k] for s in stats) / batches for k in stats[0]}

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        lead = self.rank == 0
        if lead:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            dump_yaml(cfg, self.out_dir / "config.yaml")
        logger = MetricsLogger(self.out_dir, cfg.run.iterations, enabled=lead, progress=cfg.run.progress,
                               tensorboard=cfg.run.tensorboard)
        history = []
        total_steps = 0
        t_start = time.perf_counter()
        try:
            for it in range(cfg.run.iterations):
                self.iteration = it
                t0 = time.perf_counter()
                times = RolloutTimes()
                batch = self.collect(times)
                t1 = time.perf_counter()
                learn = self.algo.update(batch, self.learn_gen)
                t2 = time.perf_counter()
                stats = episode_stats(batch)
                if self.world_size > 1:
                    stats = mean_over_group(stats)
                self.version += 1
                steps = times.env_steps * self.world_size
                total_steps += steps
                m = {
                    "version": self.version,
                    "world_size": self.world_size,
                    "env_steps": total_steps,
                    "env_steps_per_s": steps / (t2 - t0),
                    "rollout_s": t1 - t0,
                    "learn_s": t2 - t1,
                    "sim_s": times.sim_s,
                    "infer_s": times.infer_s,
                    **stats,
                    **learn,
                }
                history.append(logger.log(it, m))
                if lead and cfg.run.save_every and (it + 1) % cfg.run.save_every == 0:
                    save_weights(self.policy, self.out_dir / "weights.safetensors", self.version)
        finally:
            logger.close()
            self.env.close()
        wall = time.perf_counter() - t_start
        summary = {
            "iterations": cfg.run.iterations,
            "version": self.version,
            "env_steps": total_steps,
            "wall_s": wall,
            "env_steps_per_s": total_steps / wall if wall > 0 else 0.0,
            "final_success_rate": history[-1]["success_rate"] if history else None,
        }
        if lead:
            save_weights(self.policy, self.out_dir / "weights.safetensors", self.version)
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
