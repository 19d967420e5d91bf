"""PPO stability of a chunked Gaussian policy (issue #39): before and after the guards.

Runs the ACT-style policy of ``bench/act_policy.py`` (frozen random-init resnet18, MLP
decoder, learned log-std, value head; chunks of ``K=4`` actions of ``D=2``) with PPO on
``fast_reach`` for ``--updates`` updates and ``--seeds`` seeds in each arm:

* ``before``: the learner's defaults (no KL stop, constant learning rate, no value clipping);
* ``after``: the settings of ``AFTER``, ``algo.gamma=0.9`` (``--after KEY=VALUE ...`` replaces them).

Printed: per-update success per seed (one row per update, one column per run) and, per arm,
the median over seeds of the best success, of the final success (the mean of the last
``--tail`` updates) and of the drop from best to final; ``--json PATH`` also writes every
run's per-update records (success, approx KL, clip fraction, entropy, value loss, epochs).

    OMP_NUM_THREADS=1 python bench/ppo_stability.py --updates 40 --seeds 3
    OMP_NUM_THREADS=1 python bench/ppo_stability.py --arms after --after algo.ratio=step   # another arm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import act_policy  # noqa: E402  (registers act_vla)

from dvla.config import apply_overrides  # noqa: E402
from dvla.config.presets import fast_reach  # noqa: E402
from swimlane import Swimlane  # noqa: E402

BASE = [f"policy.name={act_policy.POLICY_NAME}", "policy.options={}", "policy.action_chunk=4",
        "env.episode_len=6", "algo.name=ppo", "algo.lr=1e-3", "algo.update_epochs=4", "algo.minibatches=4",
        "swimlane.mode=sync", "swimlane.driver=serial", "swimlane.env_groups=1", "run.progress=false"]
"""The fast_reach preset (64 envs, privileged goal, shaped reward), chunks of 4 actions over 6
decisions (24 env steps), PPO at the preset's lr 1e-3 with 4 epochs of 4 minibatches."""
AFTER = ["algo.gamma=0.9"]
"""The cure (issue #39): a discount whose horizon matches the task. ``algo.gamma`` discounts per
*decision* (a chunk of K=4 env steps), and an episode cut by ``env.episode_len`` bootstraps from
its last value, so at the default 0.99 (0.9975 per env step) reaching the goal now rather than a
decision later is worth 1% of the success reward: a slightly optimistic value near the goal
outweighs it, the advantage of the chunks that reach the goal turns negative and success decays.
0.9 per decision (horizon 10 decisions, the episode is 6) took every seed to 0.99-1.0. Other
arms measured (3 seeds each, final 0.35-0.66): ``algo.target_kl=0.01``, ``algo.ratio=step``,
``algo.ratio=dim``, ``policy.options={"tied_mean":true}`` (one mean for the whole chunk)."""
KEYS = ("success_rate", "approx_kl", "clip_frac", "entropy", "value_loss", "adv_std", "kl_early_stop",
        "minibatches_stepped", "lr")


def run(overrides: list[str], seed: int, updates: int, out: Path) -> list[dict]:
    cfg = apply_overrides(fast_reach(), [*BASE, f"run.iterations={updates}", f"run.seed={seed}",
                                         f"run.out_dir={out}", *overrides])
    cfg.validate()
    rows: list[dict] = []
    Swimlane(cfg, on_update=lambda r: rows.append({k: float(r[k]) for k in KEYS if k in r})).run()
    return rows


def curve_table(runs: dict[str, list[list[dict]]]) -> str:
    names = [f"{arm}/s{i}" for arm, rs in runs.items() for i in range(len(rs))]
    lines = ["update " + " ".join(f"{n:>9}" for n in names)]
    n = max(len(r) for rs in runs.values() for r in rs)
    for u in range(n):
        vals = [rs[i][u]["success_rate"] if u < len(rs[i]) else float("nan") for rs in runs.values()
                for i in range(len(rs))]
        lines.append(f"{u + 1:6d} " + " ".join(f"{v:9.2f}" for v in vals))
    return "\n".join(lines)


def summary(rows: list[dict], tail: int) -> tuple[float, float]:
    s = [r["success_rate"] for r in rows]
    return max(s), statistics.fmean(s[-tail:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=40)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--tail", type=int, default=5, help="final success: mean of the last TAIL updates")
    p.add_argument("--arms", default="before,after", help="which arms to run (comma-separated)")
    p.add_argument("--before", nargs="*", default=[], help="overrides of the before arm")
    p.add_argument("--after", nargs="*", default=None, help="overrides of the after arm (default: AFTER)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    arms = {"before": args.before, "after": AFTER if args.after is None else args.after}
    arms = {a: arms[a] for a in args.arms.split(",")}
    runs: dict[str, list[list[dict]]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, ov in arms.items():
            for seed in range(args.seeds):
                t0 = time.perf_counter()
                rows = run(ov, seed, args.updates, Path(tmp) / f"{arm}{seed}")
                runs[arm].append(rows)
                best, final = summary(rows, args.tail)
                print(f"{arm} seed {seed}: best {best:.2f} final {final:.2f} ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
    print(curve_table(runs))
    for arm, rs in runs.items():
        best, final = zip(*(summary(r, args.tail) for r in rs))
        stepped = [r["minibatches_stepped"] for rows in rs for r in rows if "minibatches_stepped" in r]
        if stepped:
            print(f"{arm:>6}: minibatch steps per update {statistics.fmean(stepped):.1f} (mean), "
                  f"stopped early in {sum(r.get('kl_early_stop', 0) for rows in rs for r in rows):.0f} of "
                  f"{sum(len(rows) for rows in rs)} updates")
        print(f"{arm:>6} ({' '.join(arms[arm]) or 'defaults'}): median best {statistics.median(best):.2f}, "
              f"median final {statistics.median(final):.2f}, median drop "
              f"{statistics.median(b - f for b, f in zip(best, final)):.2f}")
    if args.json:
        args.json.write_text(json.dumps({"arms": arms, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
