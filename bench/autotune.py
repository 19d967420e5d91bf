"""The resource manager (``swimlane.autotune``) against a small grid of static configs and
the sync and async defaults, on one workload, in one process.

Workloads:

* ``phase`` (default, synthetic): ``fast_reach`` whose render cost shifts mid-run, from
  ``--cost-before`` to ``--cost-after`` ms per rendered observation, ``--phase-after-s``
  seconds after the envs were built (in seconds, not renders: counted per env group,
  renders would shift later the more groups a configuration has). ``--python-before`` and
  ``--python-after`` add work that holds the GIL (a simulator written in Python), which the
  other lanes' threads cannot overlap. The best static point of one phase need not be the
  best of the other.
* ``genesis``: the default job (``genesis_reach``), shortened to ``--iterations`` updates:
  the real simulator, minutes per run.

The static grid is ``swimlane.env_groups`` x ``swimlane.take_turns``. The async default
is the grid's point (2 groups, turns off), and sync runs with 2 groups. Every configuration runs once per
repeat, in an order that rotates between repeats. Printed: env steps/s consumed by the
learner (summary ``env_steps`` over ``wall_s``) per configuration, as a median over
repeats, and autotune's ratio to the best static point and to the better of sync/async.

Targets (issue #20): on the default genesis job, autotune >= the better of sync/async and
within 5% of the best static point; on a workload whose phases shift, autotune beats the
best static point.

    python bench/autotune.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from dvla.config import apply_overrides
from dvla.config.presets import fast_reach, genesis_reach
from swimlane import Swimlane

GRID = [(groups, turns) for groups in (1, 2, 3) for turns in (0, 1)]


def settings(args) -> dict[str, list[str]]:
    out = {f"static g{g} t{t}": [f"swimlane.env_groups={g}", f"swimlane.take_turns={bool(t)}"] for g, t in GRID}
    out["sync"] = ["swimlane.mode=sync", "swimlane.env_groups=2"]
    out["autotune"] = ["swimlane.env_groups=3", "swimlane.autotune=true",
                       f"swimlane.autotune_window_s={args.window_s}"]
    return out


def run(args, out: Path, overrides: list[str]) -> float:
    if args.workload == "genesis":
        base = genesis_reach()
        common = [f"run.iterations={args.iterations}"]
    else:
        base = fast_reach()
        common = [f"run.iterations={args.iterations}", "env.image_size=16", "env.n_envs=32",
                  f"env.options.render_cost_ms={args.cost_before}", f"env.options.phase_after_s={args.phase_after_s}",
                  f"env.options.render_cost_ms_after={args.cost_after}", "run.torch_threads=1",
                  f"env.options.render_python_ms={args.python_before}",
                  f"env.options.render_python_ms_after={args.python_after}"]
    cfg = apply_overrides(base, [*common, "run.progress=false", f"run.out_dir={out}", "run.save_every=0",
                                 *overrides, *args.set])
    s = Swimlane(cfg).run()
    return s["env_steps"] / s["wall_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("phase", "genesis"), default="phase")
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cost-before", type=float, default=0.0)
    p.add_argument("--cost-after", type=float, default=8.0)
    p.add_argument("--python-before", type=float, default=0.0,
                   help="ms per render spent in Python holding the GIL, before the shift")
    p.add_argument("--python-after", type=float, default=0.0, help="... after the shift")
    p.add_argument("--phase-after-s", type=float, default=4.0)
    p.add_argument("--window-s", type=float, default=1.0)
    p.add_argument("--set", nargs="*", default=[], help="further overrides KEY=VALUE for every run")
    p.add_argument("--only", default="", help="comma-separated configurations to run (default: all)")
    args = p.parse_args()
    configs = settings(args)
    if args.only:
        configs = {n: configs[n] for n in args.only.split(",")}
    names = list(configs)
    got: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            shift = (i * 3) % len(names)
            for name in names[shift:] + names[:shift]:
                got[name].append(run(args, Path(tmp) / f"{i}_{name.replace(' ', '_')}", configs[name]))
            print(f"repeat {i}: " + ", ".join(f"{n} {got[n][-1]:.0f}" for n in names), flush=True)
    med = {n: statistics.median(v) for n, v in got.items()}
    statics = {n: v for n, v in med.items() if n.startswith("static")}
    print("medians (env steps/s): " + ", ".join(f"{n} {v:.0f}" for n, v in med.items()))
    if not statics or not {"autotune", "sync", "static g2 t0"} <= med.keys():
        return  # --only left out what the ratios need
    best = max(statics, key=statics.get)
    defaults = max(med["sync"], med["static g2 t0"])
    print(f"autotune {med['autotune']:.0f}: {med['autotune'] / med[best]:.2f}x the best static ({best}, "
          f"{med[best]:.0f}), {med['autotune'] / defaults:.2f}x the better of sync/async ({defaults:.0f})")

if __name__ == "__main__":
    main()
