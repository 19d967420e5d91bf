"""``dvla trace``: lane utilisation and a swimlane Gantt chart per rank of a run's trace
(:mod:`swimlane.observation.trace`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from swimlane.observation.trace import draw_gantt, load_trace, utilization

    p = argparse.ArgumentParser(prog="dvla trace", description="Per-lane utilisation and idle time of a "
                                "run's swimlane trace(s), and a Gantt chart PNG per rank.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (default: the newest run under runs/)")
    p.add_argument("--out", help="PNG path for rank 0 (default: RUN_DIR/gantt.png; other ranks get "
                                 "gantt_rankN.png beside it)")
    p.add_argument("--last", type=float, default=0.0, help="only draw the last S seconds (0: all)")
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    files = sorted(run.glob("trace*.json"))
    if not files:
        print(f"dvla trace: no trace*.json in {run} (was swimlane.trace false?)", file=sys.stderr)
        return 2
    for f in files:
        meta, spans = load_trace(f)
        rank = meta.get("rank", 0)
        print(f"rank {rank} ({meta.get('mode', '?')} mode), {len(spans)} spans:")
        for lane, u in utilization(spans).items():
            print(f"  {lane:<10} busy {u['busy_s']:8.2f} s  idle {u['idle_s']:8.2f} s  "
                  f"utilisation {u['utilization']:6.1%}")
        png = Path(args.out) if args.out else run / "gantt.png"
        if rank:
            png = png.with_name(f"{png.stem}_rank{rank}{png.suffix}")
        window = None
        if args.last > 0 and spans:
            end = max(s[3] for s in spans)
            window = (end - args.last, end)
        print(f"  chart: {draw_gantt(spans, png, title=f'dvla swimlane, rank {rank}', window=window)}")
    return 0
