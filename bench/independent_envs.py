"""Envs on their own clock (``swimlane.independent_envs``) against batch-synchronous episodes
on a long-tail workload, one process.

The workload is synthetic: the pure-torch reaching task (``fast_reach``) with
``options.long_tail`` (a Pareto slowness per episode, so a few episodes take many times
longer than most), a wide success radius (most episodes end early, the policy still
learning) and ``render_cost_ms`` of native CPU work per rendered observation, standing in
for a simulator's step cost: simulation is the bottleneck, as in the issue's setting. It is
not a real simulator's figure. PPO (per-env independence; GRPO groups restart together).

Independent envs keep about two chunks in flight per env group, so staleness has to allow
about two versions per group (``--max-staleness 4`` for 2 groups), or admission holds new
episodes and envs wait.

Three settings run the same job (async lanes, the same iterations): ``batch``,
``independent`` (one episode per chunk column) and ``segments`` (``swimlane.segment_len``:
columns of consecutive decisions across resets, no env ever waits). Each repeat runs all
three, the order rotated. Printed per repeat and as medians:

* useful env steps per second: decisions taken by envs whose episode runs
  (``env_steps_live`` over the run's wall time);
* the idle share: env steps spent on envs whose episode had ended, waiting for the rest of
  their batch (or of their GRPO group).

Target (issue #20): independent/batch >= 1.3x useful env steps/s (segments are reported
beside it).

    python bench/independent_envs.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from dvla.config import apply_overrides
from dvla.config.presets import fast_reach
from swimlane import Swimlane


MODES = ("batch", "independent", "segments")


def run(out: Path, mode: str, args) -> dict[str, float]:
    cfg = apply_overrides(fast_reach(), [
        f"swimlane.independent_envs={str(mode != 'batch').lower()}",
        f"swimlane.segment_len={args.segment_len if mode == 'segments' else 0}", f"run.iterations={args.iterations}",
        f"env.options.long_tail={args.long_tail}", f"env.options.render_cost_ms={args.render_cost_ms}",
        f"env.episode_len={args.episode_len}", f"env.n_envs={args.n_envs}", "env.image_size=16",
        f"swimlane.max_staleness={args.max_staleness}", "swimlane.env_groups=2", "run.torch_threads=1",
        f"env.options.radius={args.radius}", "algo.name=ppo", "policy.options.value_head=true",
        "run.progress=false", f"run.out_dir={out}", *args.set])
    s = Swimlane(cfg).run()
    live, idle = s.get("env_steps_live", 0), s.get("env_steps_idle", 0)
    return {"useful_sps": live / s["wall_s"], "idle_share": idle / max(live + idle, 1),
            "dropped": s.get("dropped_stale", 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--long-tail", type=float, default=1.5)
    p.add_argument("--render-cost-ms", type=float, default=12.0)
    p.add_argument("--radius", type=float, default=0.5)
    p.add_argument("--episode-len", type=int, default=40)
    p.add_argument("--n-envs", type=int, default=32)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--segment-len", type=int, default=10, help="decisions per chunk column in the segments setting")
    p.add_argument("--set", nargs="*", default=[], help="further overrides KEY=VALUE")
    args = p.parse_args()
    rows = {m: [] for m in MODES}
    ratios = {m: [] for m in MODES[1:]}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            order = MODES[i % 3:] + MODES[:i % 3]
            got = {mode: run(Path(tmp) / f"r{i}_{mode}", mode, args) for mode in order}
            for mode in MODES:
                rows[mode].append(got[mode])
            parts = []
            for mode in MODES[1:]:
                ratios[mode].append(got[mode]["useful_sps"] / got["batch"]["useful_sps"])
                parts.append(f"{mode} {got[mode]['useful_sps']:.0f} (idle {got[mode]['idle_share']:.0%}, "
                             f"{got[mode]['dropped']} stale chunks dropped): {ratios[mode][-1]:.2f}x")
            print(f"repeat {i} ({', '.join(order)}): batch {got['batch']['useful_sps']:.0f} useful steps/s (idle "
                  f"{got['batch']['idle_share']:.0%}); " + "; ".join(parts), flush=True)

    def med(mode, key):
        return statistics.median(r[key] for r in rows[mode])

    print(f"median: batch {med('batch', 'useful_sps'):.0f} useful steps/s, idle {med('batch', 'idle_share'):.0%}; "
          + "; ".join(f"{m} {med(m, 'useful_sps'):.0f}, idle {med(m, 'idle_share'):.0%}, "
                      f"{statistics.median(ratios[m]):.2f}x" for m in MODES[1:])
          + " (target: independent >= 1.3x batch)")


if __name__ == "__main__":
    main()
