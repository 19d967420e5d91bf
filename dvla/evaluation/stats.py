"""The statistics and the record of ``dvla eval``.

* :func:`wilson`: the 95% Wilson score interval of a success rate (sound at 0/n and n/n,
  where the normal approximation's interval collapses to a point);
* :func:`two_proportion_test`: the difference of two success rates and the two-sided p-value
  of the pooled two-proportion z-test (both arms evaluated on the same fixed states);
* :func:`provenance`: the git commit of dvla and the command line, recorded with every result;
* :func:`side_by_side`: the table of several runs, each after the first with its difference
  from the first and whether it is significant at 0.05.
"""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
from pathlib import Path

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
ALPHA = 0.05


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of ``successes / n`` (95% by default)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # (exactly 0 and 1 at 0/n and n/n, where rounding would leave a hair's width)
    return (0.0 if successes == 0 else centre - half), (1.0 if successes == n else centre + half)


def two_proportion_test(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float, float]:
    """``(p2 - p1, z, p_value)``: the pooled two-proportion z-test, two-sided. Equal rates
    of 0 or 1 in both arms (no variance) give ``z = 0, p = 1``."""
    p1, p2 = k1 / n1, k2 / n2
    pooled = (k1 + k2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if se == 0.0:
        return p2 - p1, 0.0, 1.0
    z = (p2 - p1) / se
    return p2 - p1, z, math.erfc(abs(z) / math.sqrt(2))


def git_commit() -> str:
    """``git rev-parse HEAD`` of the checkout the dvla package lives in ("unknown" outside
    one), with ``+dirty`` where tracked files differ from it."""
    where = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(argv: list[str]) -> dict:
    return {"commit": git_commit(), "command": shlex.join(["dvla", "eval", *argv]), "python": sys.version.split()[0]}


def rate_cell(successes: int, episodes: int) -> str:
    lo, hi = wilson(successes, episodes)
    return f"{successes}/{episodes} {successes / episodes:.2f} [{lo:.2f}, {hi:.2f}]"


def compare(first: dict, other: dict) -> dict:
    """``other`` against ``first`` (``{"episodes", "successes"}`` each): difference, z, p,
    and whether it is significant at 0.05."""
    diff, z, p = two_proportion_test(first["successes"], first["episodes"], other["successes"], other["episodes"])
    return {"difference": diff, "z": z, "p_value": p, "significant": p < ALPHA}


def comparisons(results: list[dict]) -> list[dict]:
    """Every run after the first against the first, overall and per task."""
    base = results[0]
    out = []
    for r in results[1:]:
        out.append({"run": r["run"], "against": base["run"], "overall": compare(base, r),
                    "tasks": {t: compare(base["tasks"][t], r["tasks"][t]) for t in base["tasks"]}})
    return out


def side_by_side(results: list[dict], compared: list[dict]) -> str:
    """The table: a row per task and one overall; per run successes/episodes, rate and 95%
    Wilson interval, and for each run after the first its difference and p-value (``*``:
    significant at 0.05)."""
    width = 30
    head = ["task".ljust(12)]
    for i, r in enumerate(results):
        head.append(f"{chr(65 + i) if i < 26 else i}: {Path(r['run']).name}"[:width].ljust(width))
        if i:
            head.append("diff      p".ljust(18))
    lines = ["  ".join(head).rstrip()]
    rows = [(str(t), [r["tasks"][t] for r in results], [c["tasks"][t] for c in compared]) for t in results[0]["tasks"]]
    rows.append(("overall", results, [c["overall"] for c in compared]))
    for name, cells, diffs in rows:
        row = [name[:12].ljust(12)]
        for i, cell in enumerate(cells):
            row.append(rate_cell(cell["successes"], cell["episodes"]).ljust(width))
            if i:
                d = diffs[i - 1]
                row.append(f"{d['difference']:+.2f}  {d['p_value']:.3f}{' *' if d['significant'] else ''}".ljust(18))
        lines.append("  ".join(row).rstrip())
    lines.append("rates with 95% Wilson intervals; diff: against A, p: pooled two-proportion z-test (two-sided), "
                 "* significant at 0.05")
    lines += [f"{chr(65 + i) if i < 26 else i}: {r['run']}" for i, r in enumerate(results)]
    return "\n".join(lines)
