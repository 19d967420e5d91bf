"""``dvla train`` (``python -m dvla.launch``, ``torchrun ... -m dvla.launch``): parse the config,
set up the process group, run the rank's swimlane, tear down.

    python -m dvla.launch --preset debug run.iterations=5
    torchrun --standalone --nproc_per_node=2 -m dvla.launch --preset fast_reach
    torchrun --standalone --nproc_per_node=2 -m dvla.launch sft --data DATASET   (dvla sft, dvla.app.sft)

Overrides are ``KEY=VALUE`` with dotted keys (``--env.n_envs=32`` works too); values
are parsed as YAML. ``--config FILE.yaml`` is applied before the overrides.

Each run writes to a directory of its own, ``{run.out_dir}/{YYYYmmdd-HHMMSS}`` (or
``{run.out_dir}/{run.name}``), and ``{run.out_dir}/latest`` points to the newest
(:mod:`dvla.state.rundir`); ``--resume`` continues that one. A mistake in the configuration or
the command line is one line on stderr and exit code 2 (``--debug`` shows the traceback); what
happens around the run on every rank is :mod:`dvla.app.run`'s, shared with ``dvla sft``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, NoReturn

from dvla.app.run import (
    EXIT_USER_ERROR,
    JobStop,
    fail,
    leave,
    local_rank,
    restarts,
    say_error,
    see_own_gpu,
    share_run_dir,
)
from dvla.config import ConfigError
from dvla.config.presets import DEFAULT_PRESET, PRESETS, compose
from dvla.distributed import init_from_env, resolve_device
from dvla.logs import setup_logging
from memory import runtime

log = logging.getLogger("dvla.launch")
PROG = "dvla"  # the prefix of its error lines


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as a ConfigError (one line; the launcher prints it)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see {self.prog} --help)")


def build_parser(prog: str = "python -m dvla.launch") -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog,
        description="Train a VLA policy with RL. Positional KEY=VALUE arguments override the config "
                    "(e.g. run.iterations=20 env.n_envs=32). Each run writes to its own directory "
                    "run.out_dir/YYYYmmdd-HHMMSS; run.out_dir/latest points to the newest.",
    )
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"one of: {', '.join(PRESETS)} (default: %(default)s)")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file applied on top of the preset")
    p.add_argument("--print-config", action="store_true", help="check the config, print it as YAML and exit")
    p.add_argument("--print-rank", nargs="?", const="all", metavar="RANKS",
                   help="print what each rank of the job is made of (role, lanes, env groups, weights, process "
                        "groups, channels, pools, streams) and exit; RANKS: 'all' (default) or e.g. 0,2. The world "
                        "is swimlane.topology, or WORLD_SIZE processes on one host (1 outside torchrun)")
    p.add_argument("--resume", action="store_true", help="continue the newest run under run.out_dir (its "
                   "latest link, or run.out_dir/run.name) from its newest valid checkpoint (same as "
                   "run.resume=true)")
    p.add_argument("-v", "--verbose", action="store_true", help="more log output: debug messages, third-party "
                   "warnings (sets DVLA_VERBOSE=1 for the simulators)")
    p.add_argument("--debug", action="store_true", help="show the Python traceback of configuration errors")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import a module (dotted name, or a .py file) that registers policies or envs; repeatable. "
                        "Packages with dvla.policies / dvla.envs entry points are found without it")
    return p


def check_config(cfg) -> None:
    """Everything that can be checked without building an env or a model: field types and
    ranges, the env's name and options, the policy's name and options (its ``Config``)."""
    from dvla.envs import check_env_config
    from dvla.policy import policy_config

    cfg.validate()
    check_env_config(cfg.env)
    policy_config(cfg.policy.name, cfg.policy.options)


def parse_config(argv: list[str] | None = None, prog: str = "python -m dvla.launch"):
    """``(args, cfg)`` from the command line; :class:`ConfigError` for any mistake in it."""
    parser = build_parser(prog)
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if "=" not in a]
    if bad:
        raise ConfigError(f"unrecognised argument(s) {' '.join(bad)}: options are listed by {prog} --help, "
                          "overrides look like env.n_envs=8")
    from dvla.plugins import load_plugins

    load_plugins(args.imports)  # before the config is checked: it may name their policies and envs
    cfg = compose(args.preset, args.config, rest, args.resume)
    check_config(cfg)
    return args, cfg


def rank_plans(cfg, which: str = "all") -> str:
    """``--print-rank``: the plans (:mod:`swimlane.assembly.plan`) of the ranks ``which`` names."""
    from swimlane.assembly.build import check_world
    from swimlane.assembly.plan import format_plan, plans_for

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if cfg.swimlane.topology:
        from launch.topology import from_spec

        try:
            world = from_spec(cfg.swimlane.topology).world_size
        except ValueError as exc:
            raise ConfigError(f"swimlane.topology: {exc}") from None
    check_world(cfg.swimlane, world)
    try:
        plans = plans_for(cfg, world)
        ranks = range(world) if which == "all" else [int(r) for r in which.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--print-rank: {exc}") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ConfigError(f"--print-rank: no rank {bad[0]} in a world of {world}")
    return "\n".join(format_plan(plans[r]) for r in ranks)


# -- the end of a run ------------------------------------------------------------------------


def human_summary(summary: dict[str, Any], run_dir: str | os.PathLike) -> str:
    """A few lines for the console: what was achieved, where it went, what to run next."""
    done, total = summary.get("version", 0), summary.get("iterations", 0)
    if summary.get("time_limit_reached"):
        head = f"stopped at the time limit after {done} of {total} updates"
    elif summary.get("stopped_early"):
        head = f"stopped after {done} of {total} updates"
    else:
        head = f"done: {done} updates"
    if summary.get("resumed_from"):
        head += f" (resumed from update {summary['resumed_from']})"
    parts = [f"{head} in {summary.get('wall_s', 0.0):.1f} s"]
    if summary.get("final_success_rate") is not None:
        parts.append(f"final success rate {summary['final_success_rate']:.2f}")
    if summary.get("env_steps_per_s") is not None:
        parts.append(f"{summary['env_steps_per_s']:.0f} env steps/s")
    run = shlex.quote(str(run_dir))
    return "\n".join([", ".join(parts), f"outputs: {run_dir}  (metrics.jsonl, summary.json, weights.safetensors)",
                      f"next:    dvla report {run}"])


def preempted_line(lanes, summary: dict[str, Any], by: str = "SIGTERM") -> str:
    """After a stop signal (``by``: which, and at which rank): where the run can be continued
    from."""
    checkpoints = lanes.parts.checkpoints
    ckpts = checkpoints.manager.list() if checkpoints is not None else []
    where = f"checkpoint {ckpts[-1]}" if ckpts else "no checkpoint (nothing to resume)"
    return (f"stopped by {by} at update {summary.get('version', 0)}: {where}; continue with --resume "
            f"(run.out_dir={Path(lanes.out_dir).parent})")


def main(argv: list[str] | None = None, prog: str = "python -m dvla.launch") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sft"]:  # the supervised warm start, on the same launcher
        from dvla.app.sft import main as sft

        return sft(argv[1:])
    try:
        see_own_gpu()  # first: nothing may start CUDA before
        args, cfg = parse_config(argv, prog)
    except ConfigError as exc:
        if "--debug" in argv:
            raise
        if local_rank() == 0:  # every rank of a torchrun job parses the same command line: say it once
            say_error(PROG, exc)
        return EXIT_USER_ERROR
    if args.verbose:
        os.environ["DVLA_VERBOSE"] = "1"  # simulators read it (e.g. genesis' repeated warnings)
    if args.print_config:
        import yaml

        from dvla.envs import env_options

        shown = cfg.to_dict()
        shown["env"]["options"] = env_options(cfg.env)  # every option the env reads, defaults included
        print(yaml.safe_dump(shown, sort_keys=False), end="")
        return 0
    if args.print_rank:
        try:
            print(rank_plans(cfg, args.print_rank))
        except ConfigError as exc:
            say_error(PROG, exc)
            return EXIT_USER_ERROR
        return 0
    return train(args, cfg)


def train(args, cfg) -> int:
    """Every rank of the job: the process group, the run directory, the rank's swimlane run to
    its end; SIGTERM stops it with a checkpoint (:meth:`swimlane.Swimlane.preempt`)."""
    setup_logging(int(os.environ.get("RANK", "0") or 0), args.verbose)
    if cfg.run.device.startswith("cuda") and not runtime.current().available():
        if local_rank() == 0:
            say_error(PROG, ConfigError(f"run.device={cfg.run.device!r} but CUDA is not available on this machine "
                                        "(run.device=auto uses a GPU where there is one, else the CPU)"))
        return EXIT_USER_ERROR
    with runtime.serving(resolve_device(cfg.run.device)):  # the rank's device runtime (memory/runtime.py)
        return _rank(args, cfg)


def _rank(args, cfg) -> int:
    import swimlane

    try:
        rank, world = init_from_env(timeout_s=cfg.swimlane.collective_timeout_s, device=cfg.run.device,
                                    collective_backend=cfg.swimlane.collective_backend)
    except ConfigError as exc:  # before any group: every rank of the host found it, the first says it
        if local_rank() == 0:
            say_error(PROG, exc)
        return EXIT_USER_ERROR
    run = None
    stop = JobStop(rank, world)  # from here on: a stop signal at any rank stops every rank
    try:
        run = share_run_dir(cfg.run.out_dir, cfg, rank, world, restarts())
        cfg.run.out_dir = str(run.path)
        if world > 1 and cfg.run.device.startswith("cuda:") and cfg.run.device != "cuda:0":
            raise ConfigError(f"run.device: {cfg.run.device!r} under torchrun: each rank sees only its own GPU, "
                              "as cuda:0 (use auto or cuda)")
        if world > 1 and cfg.run.device in ("auto", "cuda") and runtime.current().available():
            cfg.run.device = "cuda:0"  # the rank's own GPU, the one it sees (see_own_gpu)
        lanes = swimlane.Swimlane(cfg, rank=rank, world_size=world)
        if rank == 0:
            log.info("run directory: %s%s", run.path, " (continuing it)" if run.resumed else "")
        stop.attach(lanes.preempt)  # rank 0's gradient lane checkpoints on its way out
        summary = lanes.run()
    except BaseException as exc:
        return fail(PROG, exc, rank=rank, world=world, run=run, debug=args.debug)
    if rank == 0:
        print(human_summary(summary, run.path), flush=True)
        if stop.stopped:
            print(preempted_line(lanes, summary, stop.by), flush=True)
    return leave(world, stop)


if __name__ == "__main__":
    sys.exit(main())
