"""The ``dvla`` command: train, inspect and plan runs.

    dvla train [--preset NAME] [KEY=VALUE ...]   train (same as python -m dvla.launch)
    dvla report [RUN_DIR] [--out DIR]            plots (success, return, throughput, staleness,
                                                 lanes, Gantt, memory) and a text summary
    dvla trace [RUN_DIR] [--out PNG] [--last S]  lane utilisation and a swimlane Gantt chart
    dvla eval [RUN_DIR ...] [--episodes N]       success per task on fixed states (LIBERO's) or seeds, with
                                                 95% intervals; several runs side by side with p-values
    dvla plan --nodes 1,8,1024 --params 7B       placement and weight-broadcast cost on a cluster
    dvla plan --params token_vla:size=7b         ... for a registered policy's parameter count
    dvla check-policy [--import FILE.py] policy.name=NAME [policy.options.KEY=VALUE ...]
                                                 whether a policy keeps dvla's contract, check by check
    dvla config-ref [--write [FILE]]             the configuration reference, from the code
                                                 (--write: into docs/configuration.md)
    dvla bench [NAME [ARGS ...]]                 list the benchmarks, or run bench/NAME.py
    dvla record [RUN_DIR | --expert NAME] --episodes N --out DIR
                                                 a policy's or an expert's episodes as a LeRobot dataset
    dvla sft --data DATASET [--preset P] [KEY=VALUE ...]
                                                 supervised warm start on demonstrations (policy.init takes it)

RUN_DIR defaults to the newest run under runs/; a base directory (run.out_dir) means
its latest run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path


BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def bench_main(argv: list[str]) -> int:
    """``dvla bench``: the scripts in ``bench/`` with their one-line purpose; ``dvla bench
    NAME ARGS`` runs ``bench/NAME.py ARGS`` (``--help`` shows its options)."""
    import ast
    import runpy

    if not BENCH_DIR.is_dir():
        print(f"dvla bench: no bench/ directory next to the dvla package ({BENCH_DIR}); the benchmarks "
              "come with a source checkout (pip install -e .)", file=sys.stderr)
        return 2
    scripts = {p.stem: p for p in sorted(BENCH_DIR.glob("*.py"))}
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: dvla bench NAME [ARGS ...]   (results and commands: bench/RESULTS.md)\n")
        for name, path in scripts.items():
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            print(f"  {name:<16} {doc.splitlines()[0] if doc else ''}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in scripts:
        print(f"dvla bench: unknown benchmark {name!r}; available: {', '.join(scripts)}", file=sys.stderr)
        return 2
    sys.argv = [str(scripts[name]), *rest]
    runpy.run_path(str(scripts[name]), run_name="__main__")
    return 0


def trace_main(argv: list[str]) -> int:
    from swimlane.trace import draw_gantt, load_trace, utilization

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


COMMANDS = {
    "train": "train a policy (same as python -m dvla.launch)",
    "report": "plots and a text summary of a run",
    "trace": "lane utilisation and a Gantt chart of a run",
    "eval": "success per task of runs' policies on fixed states, with intervals; runs side by side",
    "plan": "placement and modelled weight-broadcast cost on a cluster",
    "check-policy": "whether a policy (--import FILE.py policy.name=NAME) keeps dvla's contract",
    "config-ref": "the configuration reference, generated from the code",
    "bench": "list the benchmarks in bench/, or run one",
    "record": "a policy's or a scripted expert's episodes as a LeRobot dataset",
    "sft": "supervised warm start of a policy on a demonstration dataset (then policy.init=RUN_DIR)",
    "keys": "make persistent CurveZMQ client keys, one per rank (data_plane.curve_keys_dir)",
}


def usage() -> str:
    lines = ["usage: dvla COMMAND [ARGS ...]", "", "commands:"]
    for cmd, what in COMMANDS.items():
        lines.append(f"  dvla {cmd:<12} {what}")
    lines += ["", "dvla COMMAND --help shows a command's options. report, trace and eval take the newest run under",
              "runs/ when no RUN_DIR is given. Quick start:",
              "  dvla train --preset fast_reach      # writes runs/fast_reach/<time>, runs/fast_reach/latest",
              "  dvla report                         # plots and a summary of that run"]
    return "\n".join(lines)


def resolve_run_argument(cmd: str, argv: list[str], value_options: tuple[str, ...]) -> list[str] | None:
    """``argv`` of ``report`` / ``trace`` with its RUN_DIR resolved: absent, the newest run
    under ``runs/`` (said on stderr); a base directory, its ``latest`` run. None (after a
    message) when there is no run to use."""
    from dvla.rundir import find_latest_run, resolve_run_arg

    if any(a in ("-h", "--help") for a in argv):
        return argv
    i, positional = 0, None
    while i < len(argv):
        a = argv[i]
        if a in value_options:
            i += 2
            continue
        if not a.startswith("-"):
            positional = i
            break
        i += 1
    if positional is None:
        run = find_latest_run("runs")
        if run is None:
            print(f"dvla {cmd}: no RUN_DIR given and no run found under runs/; pass a run directory "
                  "(run.out_dir/<time>, or run.out_dir for its latest run)", file=sys.stderr)
            return None
        print(f"dvla {cmd}: using the newest run, {run}", file=sys.stderr)
        return [str(run), *argv]
    run = resolve_run_arg(argv[positional])
    if str(run) != argv[positional]:
        print(f"dvla {cmd}: using {run} ({argv[positional]}'s latest run)", file=sys.stderr)
    return [*argv[:positional], str(run), *argv[positional + 1:]]


def take_imports(argv: list[str]) -> list[str]:
    """Load the plugins named by ``--import MODULE`` in ``argv`` (and entry points); the
    rest of ``argv``."""
    from dvla.plugins import load_plugins

    rest, imports, it = [], [], iter(argv)
    for a in it:
        if a == "--import":
            imports.append(next(it, ""))
        elif a.startswith("--import="):
            imports.append(a.split("=", 1)[1])
        else:
            rest.append(a)
    if imports:
        load_plugins(imports)
    return rest


def keys_main(argv: list[str]) -> int:
    import argparse

    from planes.keys import make_keys

    ap = argparse.ArgumentParser(prog="dvla keys", description=(
        "Make a CurveZMQ keypair per rank: DIR/secret/rank{r}.key_secret (data_plane.curve_keys_dir=DIR on "
        "that rank's host) and DIR/public/rank{r}.key (copy those to admit into data_plane.curve_authorized_dir). "
        "Existing keys are kept."))
    ap.add_argument("directory")
    ap.add_argument("--ranks", type=int, required=True, help="world size: keys rank0 .. rank{N-1}")
    args = ap.parse_args(argv)
    if args.ranks < 1:
        ap.error(f"--ranks must be >= 1, got {args.ranks}")
    made = make_keys(args.directory, [f"rank{r}" for r in range(args.ranks)])
    print(f"{len(made)} keys in {args.directory}/secret (secret) and {args.directory}/public (public); run with "
          f"data_plane.curve=true data_plane.curve_keys_dir={args.directory} "
          f"data_plane.curve_authorized_dir={args.directory}/public")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] not in COMMANDS:
        what = "option" if argv[0].startswith("-") else "command"
        print(f"dvla: unknown {what} {argv[0]!r}; commands: {', '.join(COMMANDS)} (dvla --help)", file=sys.stderr)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd != "train":  # train takes --import itself (as python -m dvla.launch does)
        try:
            rest = take_imports(rest)
        except Exception as exc:  # a ConfigError from the user's module
            print(f"dvla {cmd}: error: {exc}", file=sys.stderr)
            return 2
    if cmd == "train":
        from dvla.launch import main as train

        return train(rest, prog="dvla train")
    if cmd == "bench":
        return bench_main(rest)
    if cmd in ("report", "trace"):
        resolved = resolve_run_argument(cmd, rest, ("--out",) if cmd == "report" else ("--out", "--last"))
        if resolved is None:
            return 2
        if cmd == "trace":
            return trace_main(resolved)
        from dvla.report import main as report

        return report(resolved)
    if cmd == "eval":
        # (the first RUN_DIR, or the newest run; evaluation resolves the others' base directories)
        resolved = resolve_run_argument(cmd, rest, ("--suite", "--tasks", "--episodes", "--n-envs", "--workers",
                                                    "--seed", "--out"))
        if resolved is None:
            return 2
        from dvla.evaluation import main as evaluate

        return evaluate(resolved)
    if cmd == "keys":
        return keys_main(rest)
    if cmd in ("record", "sft"):  # both read or write datasets: pyarrow, h5py
        try:
            importlib.import_module("dvla.datasets.record" if cmd == "record" else "dvla.sft")
        except ImportError as exc:
            print(f"dvla {cmd}: error: needs the data extra (pip install -e \".[data]\"): {exc}", file=sys.stderr)
            return 2
        if cmd == "sft":  # on the training launcher (also under torchrun: -m dvla.cli sft)
            from dvla.launch import sft

            return sft(rest)
        from dvla.datasets.record import main as record

        return record(rest)
    if cmd == "check-policy":
        from dvla.contract import main as check_policy

        return check_policy(rest)
    if cmd == "config-ref":
        from dvla.config_doc import main as config_ref

        return config_ref(rest)
    from launch.plan_cli import main as plan

    try:
        rest = policy_params(rest)
    except ValueError as exc:
        print(f"dvla plan: {exc}", file=sys.stderr)
        return 2
    return plan(rest)


def policy_params(argv: list[str]) -> list[str]:
    """``--params POLICY[:KEY=VALUE,...]`` (a registered policy and options) -> ``--params N``,
    its parameter count, from the model built on the meta device (no memory, no weights)."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--params" and i + 1 < len(argv) else None
        if value is None and arg.startswith("--params="):
            value = arg.split("=", 1)[1]
        if value is None or not value[:1].isalpha():
            continue
        import torch

        from dvla.config import ConfigError, parse_override
        from dvla.models import TinyVLA  # noqa: F401 (registers the built-in policies)
        from dvla.policy import PolicySpec, build_policy

        name, _, opts = value.partition(":")
        try:
            options = {k: v for kv in opts.split(",") if kv for k, v in parse_override(kv).items()}
            with torch.device("meta"):  # a 7B model's shapes, not its memory
                policy = build_policy(name, PolicySpec((3, 224, 224), 8, 7, 1), options)
        except (ConfigError, ValueError) as exc:
            raise ValueError(f"--params {value}: {exc}") from None
        count = str(sum(p.numel() for p in policy.parameters()))
        if arg == "--params":
            argv[i + 1] = count
        else:
            argv[i] = f"--params={count}"
        break
    return argv


if __name__ == "__main__":
    sys.exit(main())
