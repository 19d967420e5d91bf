"""Swimlane (async) against its own sync mode on the same config and workload, one process.

The workload is the pure-torch reaching task with ``render_cost_ms`` of native CPU work
per rendered observation (GIL released, like a real simulator's renderer). The issue's
target asks for a workload where simulation and model time are comparable, so by default
the bench sizes it on the machine at hand: a sync run without render cost measures
inference + learning time and the number of rendered observations, and the render cost is
set so that model time is ``--model-share`` (default 0.85) of simulation time. Simulation
is then the largest stage and the bound sits just under two cores. A fixed
``--render-cost-ms`` skips the calibration (with ``--render-cost-ms 9`` model time exceeds
simulation time here and the bound is the core cap: three busy lanes on two cores). Sync
and async runs alternate (``--repeats`` pairs, sync first in even pairs, async first in odd
ones) so both see the same machine state.

Two settings differ from the framework's defaults (``BENCH_CONFIG``), both for this
CPU-only run where all lanes share two cores:

* ``algo.proximal=loglinear``: the async learner then does the same work per update as
  the sync one. The bound is taken from the sync run, where no step is stale; with
  ``recompute`` the async learner also runs a forward pass over every stale step (most of
  them here), work the bound does not count.
* ``swimlane.gradient_nice=3``: simulation is the critical path and learning has slack,
  so the kernel may favour the sampling and inference lanes while all three want a core.

``--set KEY=VALUE ...`` overrides any setting after them (``--set algo.proximal=recompute
swimlane.gradient_nice=0`` measures the framework's defaults).

Printed per pair: env steps/s of each mode and their ratio, and the *ideal bound* of
the overlap: the sync run's stage times (simulation, inference, learning, broadcast,
taken from its trace) summed, divided by the largest, and capped by the CPU cores.
Targets: async/sync >= 0.9 x bound, and >= 1.6 where the stages are comparable.

    python bench/async_vs_sync.py --iterations 24 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch

from dvla.config import apply_overrides
from dvla.config.presets import fast_reach
from swimlane import Swimlane, draw_gantt, load_trace

BENCH_CONFIG = ["algo.proximal=loglinear", "swimlane.gradient_nice=3"]  # see the docstring
STAGES = {"simulation": ("sampling", ("sim", "reset")), "inference": ("inference", ("infer", "value")),
          "learning": ("gradient", ("learn", "snapshot")), "broadcast": ("broadcast", ("publish",))}


def stage_times(spans) -> dict[str, float]:
    return {name: sum(e - b for ln, k, b, e in spans if ln == lane and k in kinds)
            for name, (lane, kinds) in STAGES.items()}


def run(mode: str, args, out: Path) -> tuple[float, list]:
    cost = [f"env.options.render_cost_ms={args.render_cost_ms}"] if args.env == "fast_reach" else []
    cfg = apply_overrides(fast_reach(), [
        f"env.name={args.env}", f"swimlane.mode={mode}", f"run.iterations={args.iterations}", f"env.n_envs={args.envs}",
        f"env.image_size={args.image}", "env.episode_len=12", *cost,
        f"swimlane.env_groups={args.groups}", f"swimlane.chunks_per_update={args.groups}",
        "swimlane.max_staleness=1",
        f"run.torch_threads={args.threads}", "run.progress=false", f"run.out_dir={out}", *BENCH_CONFIG, *args.set,
    ])
    summary = Swimlane(cfg).run()
    _, spans = load_trace(out / "trace.json")
    return summary["env_steps_per_s"], spans


def calibrate(args, out: Path) -> float:
    """Render cost (ms per observation) that makes inference + learning ``model_share`` of
    simulation time, from a sync run without render cost. It runs as many updates as the
    measured runs: learning time per update falls as episodes start to succeed (and end)
    early, so a shorter run would overestimate it."""
    _, spans = run("sync", argparse.Namespace(**{**vars(args), "render_cost_ms": 0.0}), out)
    st = stage_times(spans)
    renders = sum(1 for lane, kind, _, _ in spans if lane == "sampling" and kind in ("sim", "reset"))
    model = st["inference"] + st["learning"]
    cost_ms = max((model / args.model_share - st["simulation"]) / renders * 1e3, 0.0)
    print(f"calibration (sync, {args.iterations} updates, no render cost): simulation {st['simulation']:.2f} s over {renders} "
          f"rendered observations, inference {st['inference']:.2f} s, learning {st['learning']:.2f} s -> "
          f"render cost {cost_ms:.1f} ms per observation (model time {args.model_share:.2f} of simulation)",
          flush=True)
    return cost_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="fast_reach", choices=["fast_reach", "genesis_reach"],
                    help="genesis_reach: the real simulator (its GPU backend with --set run.device=cuda); "
                         "no render cost is added or calibrated")
    ap.add_argument("--iterations", type=int, default=24)
    ap.add_argument("--envs", type=int, default=32)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--render-cost-ms", type=float, default=None,
                    help="fixed render cost per observation (default: calibrated, see --model-share)")
    ap.add_argument("--model-share", type=float, default=0.85,
                    help="calibration: inference + learning time as a share of simulation time")
    ap.add_argument("--groups", type=int, default=2, help="env groups per rank (= chunks per update)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (shared by inference and learning)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for every run, applied after BENCH_CONFIG")
    ap.add_argument("--gantt", default="bench/swimlane_gantt.png")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    print("settings beyond the fast_reach preset and the workload: " + " ".join(BENCH_CONFIG + args.set), flush=True)
    torch.set_num_threads(args.threads)
    ratios, effs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        run("async", argparse.Namespace(**{**vars(args), "iterations": 3, "render_cost_ms": 0.0}), Path(tmp) / "warm")
        if args.env != "fast_reach":
            args.render_cost_ms = 0.0
        if args.render_cost_ms is None:
            args.render_cost_ms = calibrate(args, Path(tmp) / "calibrate")
        for i in range(args.repeats):
            runs = {}
            for mode in (("sync", "async") if i % 2 == 0 else ("async", "sync")):  # neither always goes first
                runs[mode] = run(mode, args, Path(tmp) / f"{mode}{i}")
            (sync_sps, sync_spans), (async_sps, async_spans) = runs["sync"], runs["async"]
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
    print(f"cores {cores}; render cost {args.render_cost_ms:.1f} ms; median async/sync {statistics.median(ratios):.2f} "
          f"(target >= 1.6); median async/sync / bound {statistics.median(effs):.2f} (target >= 0.9); "
          f"Gantt chart: {png}")


if __name__ == "__main__":
    main()
