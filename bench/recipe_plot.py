"""The plot of a LIBERO recipe run (``bench/libero_recipe.sh``): success over RL updates.

    python bench/recipe_plot.py OUT [--out recipe.png]

Two kinds of points, labelled apart because they measure different things:

* each RL update's training success (``metrics.jsonl`` of ``OUT/rl*/latest``, one series per
  RL run, labelled with its ``policy.temperature``; sampled actions, from the sampled initial
  states RL trains on), with a moving mean;
* ``dvla eval`` on the suite's fixed initial states (most likely actions) with 95% Wilson
  intervals: the SFT run at update 0 (``OUT/eval_sft.json``) and each RL run at each update it
  was evaluated after (``OUT/eval_sft_vs_<rl run>_v*.json``, or ``OUT/eval_<rl run>_v*.json`` for
  an evaluation of the RL run alone).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dvla.config import JobConfig, load_yaml


def _eval_points(out: Path, name: str) -> list[tuple[int, dict]]:
    """(update, result) of every evaluation of RL run ``name`` there is (side by side with the
    SFT run, or of the RL run alone: ``eval_<name>_v*.json``), in update order."""
    points = []
    for f in [*out.glob(f"eval_sft_vs_{name}_v*.json"), *out.glob(f"eval_{name}_v*.json")]:
        r = json.loads(f.read_text())["runs"][-1]
        points.append((int(r["checkpoint_version"]), r))
    return sorted(points, key=lambda p: p[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="the recipe's OUT directory")
    p.add_argument("--out", help="the PNG to write (default OUT/recipe.png)")
    p.add_argument("--window", type=int, default=5, help="updates in the moving mean")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.run)
    fig, ax = plt.subplots(figsize=(8, 6))
    points = []
    if (out / "eval_sft.json").is_file():
        points.append((0, json.loads((out / "eval_sft.json").read_text())["runs"][0], "SFT", "#333333"))
    runs = sorted(d for d in out.glob("rl*") if (d / "latest" / "metrics.jsonl").is_file())
    for d, (light, dark) in zip(runs, [("#9ecae1", "#2171b5"), ("#fdae6b", "#d94801"), ("#a1d99b", "#238b45")]):
        temp = f"{load_yaml(JobConfig(), d / 'latest' / 'config.yaml').policy.temperature:g}"
        rows = [json.loads(line) for line in (d / "latest" / "metrics.jsonl").read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("success_rate") is not None]
        x = [int(r.get("version") or i + 1) for i, r in enumerate(rows)]
        y = [float(r["success_rate"]) for r in rows]
        ax.plot(x, y, ".", color=light, label=f"training episodes, temperature {temp} (sampled states and actions)")
        if len(y) >= args.window:
            w = args.window
            ax.plot(x[w - 1:], [sum(y[i - w + 1:i + 1]) / w for i in range(w - 1, len(y))], color=dark,
                    label=f"moving mean of {w} updates, temperature {temp}")
        points += [(u, r, f"RL, temperature {temp}", dark) for u, r in _eval_points(out, d.name)]
    labelled = set()
    for update, r, what, color in points:
        lo, hi = r["ci95"]
        rate = r["successes"] / r["episodes"]
        label = None if what in labelled else f"dvla eval of {what}, fixed states (95% Wilson)"
        labelled.add(what)
        ax.errorbar([update], [rate], yerr=[[rate - lo], [hi - rate]], fmt="o", color=color, capsize=4, label=label)
        ax.annotate(f"{r['successes']}/{r['episodes']}", (update, rate), textcoords="offset points", xytext=(6, 6))
    ax.set_xlabel("RL update (policy version)")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.03, 1.03)
    ax.set_title("LIBERO recipe: SFT, then GRPO from it")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=7)
    fig.tight_layout()
    dest = Path(args.out) if args.out else out / "recipe.png"
    fig.savefig(dest, dpi=120)
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
