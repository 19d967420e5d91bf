"""Swimlane (async) against its own sync mode on the same config and workload, one process.

The workload is the pure-torch reaching task with ``render_cost_ms`` of native CPU work
per rendered observation (GIL released, like a real simulator's renderer), sized so
that simulation and model time (inference + learning) are comparable: by default
simulation is the largest stage and inference + learning take ~85% of its time, so the
bound sits just under the two cores of the development machine. With
``--render-cost-ms 9`` model time exceeds simulation time and the bound is the core cap
itself (three busy lanes packed onto two cores). Sync and async
runs alternate (``--repeats`` pairs) so both see the same machine state.

Printed per pair: env steps/s of each mode and their ratio, and the *ideal bound* of
the overlap: the sync run's stage times (simulation, inference, learning, broadcast,
taken from its trace) summed, divided by the largest, and capped by the CPU cores.
Targets: async/sync >= 0.9 x bound, and >= 1.6 where the stages are comparable.

    python bench/async_vs_sync.py --render-cost-ms 20 --iterations 24 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch

from dvla.config import apply_overrides
from dvla.presets import fast_reach
from swimlane import Swimlane, draw_gantt, load_trace

STAGES = {"simulation": ("sampling", ("sim", "reset")), "inference": ("inference", ("infer", "value")),
          "learning": ("gradient", ("learn", "snapshot")), "broadcast": ("broadcast", ("publish",))}


def stage_times(spans) -> dict[str, float]:
    return {name: sum(e - b for ln, k, b, e in spans if ln == lane and k in kinds)
            for name, (lane, kinds) in STAGES.items()}


def run(mode: str, args, out: Path) -> tuple[float, list]:
    cfg = apply_overrides(fast_reach(), [
        f"swimlane.mode={mode}", f"run.iterations={args.iterations}", f"env.n_envs={args.envs}",
        f"env.image_size={args.image}", "env.episode_len=12", f"env.options.render_cost_ms={args.render_cost_ms}",
        f"swimlane.env_groups={args.groups}", f"swimlane.chunks_per_update={args.groups}",
        "swimlane.max_staleness=1",
        f"run.torch_threads={args.threads}", "run.progress=false", f"run.out_dir={out}",
    ])
    summary = Swimlane(cfg).run()
    _, spans = load_trace(out / "trace.json")
    return summary["env_steps_per_s"], spans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=24)
    ap.add_argument("--envs", type=int, default=32)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--render-cost-ms", type=float, default=20.0)
    ap.add_argument("--groups", type=int, default=2, help="env groups per rank (= chunks per update)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (shared by inference and learning)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gantt", default="bench/swimlane_gantt.png")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(args.threads)
    ratios, effs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        run("async", argparse.Namespace(**{**vars(args), "iterations": 3}), Path(tmp) / "warm")
        for i in range(args.repeats):
            sync_sps, sync_spans = run("sync", args, Path(tmp) / f"sync{i}")
            async_sps, async_spans = run("async", args, Path(tmp) / f"async{i}")
            st = stage_times(sync_spans)
            bound = min(sum(st.values()) / max(st.values()), cores)
            ratio = async_sps / sync_sps
            ratios.append(ratio)
            effs.append(ratio / bound)
            print(f"pair {i}: sync {sync_sps:7.0f} steps/s  async {async_sps:7.0f} steps/s  ratio {ratio:.2f}  "
                  f"bound {bound:.2f} (stages s: " + ", ".join(f"{k} {v:.2f}" for k, v in st.items()) + ")",
                  flush=True)
        t_end = max(s[3] for s in async_spans)
        png = draw_gantt(async_spans, args.gantt, title="dvla swimlane, async mode (last 2 s)",
                         window=(t_end - 2.0, t_end))
    print(f"cores {cores}; median async/sync {statistics.median(ratios):.2f}; "
          f"median async/sync / bound {statistics.median(effs):.2f}; Gantt chart: {png}")


if __name__ == "__main__":
    main()
