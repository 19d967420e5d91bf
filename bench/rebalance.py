"""Rebalancing around a straggler: static placement against ``swimlane.rebalance``.

One machine stands in for a skewed cluster. ``torchrun`` starts three ranks: rank 0 learns
(``swimlane.colocate=false``), ranks 1 and 2 roll out ``fast_reach`` (the learning preset,
GRPO) with two env groups each. Every render waits ``--wait-ms`` (``env.options.
render_wait_ms``: a simulator on a host of its own, which uses no core here), and rank 2's
waits ``--slow`` times longer: it is that many times slower. The workload is synthetic.

* ``static``: shares and env groups fixed at start (admission gives both ranks half of the
  learner's chunks, so rank 1 waits for weights that rank 2 has not earned yet);
* ``adaptive``: ``swimlane.rebalance=true`` with one spare group per rank: shares follow
  the measured speeds and rank 2 hands env groups to rank 1 (swimlane/adaptation/balance.py).

With ``--mode sync`` both run in sync mode, and ``adaptive`` is ``swimlane.reissue=true``:
rank 1 samples the round's work again while it waits, so the learner's round need not wait
for rank 2 (what arrives late is dropped and counted).

With ``--mode roles`` the workload has two phases. Rank 0 learns and also rolls out
(colocated), ranks 1 and 2 roll out. Every forward pass of the learner waits
``--learn-wait-ms`` (``tiny_vla``'s ``learn_wait_ms``: a larger model on an accelerator of its
own, which uses no core here). For the first ``--phase-s`` seconds the renders wait as above
(rank 2 a straggler) and the rollouts are the bottleneck; then the renders wait 2 ms, and
learning is. ``static`` keeps one learner; ``adaptive`` has rank 1 as a learner candidate
(``swimlane.roles=adaptive``, :mod:`swimlane.adaptation.roles`) besides the rebalancing, so that it can
stop sampling and join the learners while learning is the bottleneck.

    python bench/rebalance.py --mode roles --repeats 2 --iterations 80 --wait-ms 150 --slow 5

Each repeat runs both, the order alternating. Printed per run and as medians: env steps per
second consumed by the learner (its run's ``env_steps_per_s``), and the mean success rate of
the last quarter of the updates (so that faster data does not come at the cost of learning).
Target (issue #21): adaptive >= 1.3x static env steps/s, success within noise.

    python bench/rebalance.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(out: Path, adaptive: bool, args) -> dict[str, float]:
    roles = args.mode == "roles"
    phases = [f"env.options.phase_after_s={args.phase_s}", "env.options.render_wait_ms_after=2",
              f"policy.options.learn_wait_ms={args.learn_wait_ms}"] if roles else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "-m",
           "dvla.launch", "--preset", "fast_reach", f"swimlane.colocate={roles}", "swimlane.env_groups=2",
           f"swimlane.mode={'async' if roles else args.mode}", *phases,
           "run.torch_threads=1", "run.progress=false", f"run.iterations={args.iterations}",
           f"env.options.render_wait_ms={args.wait_ms}",
           f"env.rank_options.2.render_wait_ms={args.wait_ms * args.slow}",
           f"swimlane.max_staleness={args.max_staleness}", f"run.out_dir={out}", "run.name=r",
           *(adaptive_overrides(args) if adaptive else []), *args.set]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=1200)
    s = json.loads((out / "r" / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "r" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tail = [r["success_rate"] for r in rows[-max(1, len(rows) // 4):] if r.get("success_rate") is not None]
    return {"sps": s["env_steps_per_s"], "success": sum(tail) / max(len(tail), 1),
            "moves": len(s.get("balance", {}).get("moves", [])), "dropped": s["totals"].get("dropped_stale", 0),
            "switches": len(s.get("balance", {}).get("roles", {}).get("switches", [])),
            "phases": [rate(rows, 0.0, args.phase_s), rate(rows, args.phase_s, float("inf"))] if roles else None}


def rate(rows: list[dict], start: float, end: float) -> float:
    """Env steps/s consumed between the updates logged in ``[start, end)`` seconds (the
    metrics' ``time``): one phase of ``--mode roles``."""
    inside = [r for r in rows if start <= r["time"] < end]
    if len(inside) < 2 or inside[-1]["time"] <= inside[0]["time"]:
        return float("nan")
    return (inside[-1]["env_steps"] - inside[0]["env_steps"]) / (inside[-1]["time"] - inside[0]["time"])


def adaptive_overrides(args) -> list[str]:
    if args.mode == "sync":
        return ["swimlane.reissue=true"]
    roles = ["swimlane.learner_ranks=2", "swimlane.roles=adaptive"] if args.mode == "roles" else []
    return [*roles, "swimlane.rebalance=true", "swimlane.spare_groups=1", f"swimlane.balance_window_s={args.window_s}",
            f"swimlane.straggler_factor={args.straggler_factor}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("async", "sync", "roles"), default="async",
                   help="async: rebalancing; sync: re-issuing a round's work; roles: a straggler phase, then a "
                        "learning-bound one, with adaptive roles")
    p.add_argument("--phase-s", type=float, default=40.0, help="roles: seconds until the renders stop waiting")
    p.add_argument("--learn-wait-ms", type=float, default=100.0,
                   help="roles: what each of the learner's forward passes waits (learning's cost)")
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--wait-ms", type=float, default=25.0)
    p.add_argument("--slow", type=float, default=3.0, help="how many times slower rank 2 renders")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--window-s", type=float, default=5.0)
    p.add_argument("--straggler-factor", type=float, default=1.5,
                   help="with two rollout ranks the median is their mean: a rank 3x slower is below 1/1.5 of it")
    p.add_argument("--set", nargs="*", default=[], help="further overrides KEY=VALUE for both")
    args = p.parse_args()
    got = {False: [], True: []}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            order = (False, True) if i % 2 == 0 else (True, False)
            res = {mode: run(Path(tmp) / f"r{i}_{mode}", mode, args) for mode in order}
            for mode in order:
                got[mode].append(res[mode])
            ratios.append(res[True]["sps"] / res[False]["sps"])
            print(f"repeat {i}: static {res[False]['sps']:.0f} env steps/s (success {res[False]['success']:.2f}), "
                  f"adaptive {res[True]['sps']:.0f} (success {res[True]['success']:.2f}, {res[True]['moves']} "
                  f"group moves, {res[True]['switches']} role switches, {res[True]['dropped']} stale chunks "
                  f"dropped): {ratios[-1]:.2f}x", flush=True)
            if args.mode == "roles":
                (s1, s2), (a1, a2) = res[False]["phases"], res[True]["phases"]
                print(f"  by phase: straggler {s1:.0f} / {a1:.0f} ({a1 / s1:.2f}x), learning-bound {s2:.0f} / "
                      f"{a2:.0f} ({a2 / s2:.2f}x)", flush=True)

    def med(mode, key):
        return statistics.median(r[key] for r in got[mode])

    print(f"median: static {med(False, 'sps'):.0f} env steps/s, success {med(False, 'success'):.2f}; adaptive "
          f"{med(True, 'sps'):.0f}, success {med(True, 'success'):.2f}; ratio {statistics.median(ratios):.2f}x "
          f"(target >= 1.3x)")


if __name__ == "__main__":
    main()
