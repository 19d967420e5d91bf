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
    dvla export [RUN_DIR] --format lerobot|openpi --out DIR
                                                 a run's pi0 in the reference's layout, for its code to load

RUN_DIR defaults to the newest run under runs/; a base directory (run.out_dir) means
its latest run.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    module: str  # its application module under dvla.app, with main(argv)
    what: str
    run_options: tuple[str, ...] | None = None  # takes a RUN_DIR first: the options that take a value
    needs: str = ""  # an extra its imports need


COMMANDS = {
    "train": Command("train", "train a policy (same as python -m dvla.launch)"),
    "report": Command("report.make", "plots and a text summary of a run", ("--out",)),
    "trace": Command("trace", "lane utilisation and a Gantt chart of a run", ("--out", "--last")),
    # (eval: the first RUN_DIR, or the newest run; evaluation resolves the others' base directories)
    "eval": Command("eval", "success per task of runs' policies on fixed states, with intervals; runs side by side",
                    ("--suite", "--tasks", "--episodes", "--n-envs", "--workers", "--seed", "--out")),
    "plan": Command("plan", "placement and modelled weight-broadcast cost on a cluster"),
    "check-policy": Command("check_policy", "whether a policy (--import FILE.py policy.name=NAME) keeps dvla's contract"),
    "config-ref": Command("config_ref", "the configuration reference, generated from the code"),
    "bench": Command("bench", "list the benchmarks in bench/, or run one"),
    "record": Command("record", "a policy's or a scripted expert's episodes as a LeRobot dataset", needs="data"),
    "sft": Command("sft", "supervised warm start of a policy on a demonstration dataset (then policy.init=RUN_DIR)",
                   needs="data"),
    "export": Command("export", "a run's policy in its reference's layout (pi0: LeRobot's or openpi's)",
                      ("--format", "--out")),
    "keys": Command("keys", "make persistent CurveZMQ client keys, one per rank (data_plane.curve_keys_dir)"),
}


def usage() -> str:
    lines = ["usage: dvla COMMAND [ARGS ...]", "", "commands:"]
    for name, cmd in COMMANDS.items():
        lines.append(f"  dvla {name:<12} {cmd.what}")
    lines += ["", "dvla COMMAND --help shows a command's options. report, trace and eval take the newest run under",
              "runs/ when no RUN_DIR is given. Quick start:",
              "  dvla train --preset fast_reach      # writes runs/fast_reach/<time>, runs/fast_reach/latest",
              "  dvla report                         # plots and a summary of that run"]
    return "\n".join(lines)


def resolve_run_argument(cmd: str, argv: list[str], value_options: tuple[str, ...]) -> list[str] | None:
    """``argv`` of ``report`` / ``trace`` with its RUN_DIR resolved: absent, the newest run
    under ``runs/`` (said on stderr); a base directory, its ``latest`` run. None (after a
    message) when there is no run to use."""
    from dvla.state.rundir import find_latest_run, resolve_run_arg

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
    name, rest = argv[0], argv[1:]
    cmd = COMMANDS[name]
    if name == "train":  # train takes --import itself (as python -m dvla.launch does)
        from dvla.app.train import main as train

        return train(rest, prog="dvla train")
    try:
        rest = take_imports(rest)
    except Exception as exc:  # a ConfigError from the user's module
        print(f"dvla {name}: error: {exc}", file=sys.stderr)
        return 2
    if cmd.run_options is not None:
        rest = resolve_run_argument(name, rest, cmd.run_options)
        if rest is None:
            return 2
    try:
        app = importlib.import_module(f"dvla.app.{cmd.module}")
    except ImportError as exc:
        if not cmd.needs:
            raise
        print(f"dvla {name}: error: needs the {cmd.needs} extra (pip install -e \".[{cmd.needs}]\"): {exc}",
              file=sys.stderr)
        return 2
    return app.main(rest)


if __name__ == "__main__":
    sys.exit(main())
