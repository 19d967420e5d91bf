"""Entry point: parse the config, set up the process group, train, tear down.

    python -m dvla.launch --preset debug run.iterations=5
    torchrun --standalone --nproc_per_node=2 -m dvla.launch --preset fast_reach
    torchrun --standalone --nproc_per_node=2 -m dvla.launch sft --data DATASET   (dvla sft, dvla.sft)

Overrides are ``KEY=VALUE`` with dotted keys (``--env.n_envs=32`` works too); values
are parsed as YAML. ``--config FILE.yaml`` is applied before the overrides.

Each run writes to a directory of its own, ``{run.out_dir}/{YYYYmmdd-HHMMSS}`` (or
``{run.out_dir}/{run.name}``), and ``{run.out_dir}/latest`` points to the newest
(:mod:`dvla.rundir`); ``--resume`` continues that one. A mistake in the configuration or
the command line is one line on stderr and exit code 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn


from dvla.config import ConfigError
from dvla.distributed import init_from_env, shutdown, uses_nccl
from dvla.logs import setup_logging
from dvla.presets import DEFAULT_PRESET, PRESETS, compose
from memory import runtime

log = logging.getLogger("dvla.launch")
EXIT_USER_ERROR = 2


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
    """``--print-rank``: the plans (:mod:`swimlane.plan`) of the ranks ``which`` names."""
    from swimlane.build import check_world
    from swimlane.plan import format_plan, plans_for

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


# -- run directory ---------------------------------------------------------------------------


def _choose_run_dir(cfg, restarts: int) -> tuple[Path, bool, Path | None]:
    from dvla.rundir import pick_run_dir

    return pick_run_dir(cfg.run.out_dir, cfg, restarts)


class _RelayedError(ConfigError):
    """Rank 0's configuration error, as the other ranks learn it."""


def share_run_dir(cfg, rank: int, world: int, restarts: int) -> tuple[Path, bool, Path | None]:
    """Rank 0 chooses the run directory (:mod:`dvla.rundir`) and tells the other ranks
    through the torch.distributed store, so that every rank writes to the same one.
    Returns ``(run directory, whether it continues a run, the previous latest run)``."""
    if world == 1:
        return _choose_run_dir(cfg, restarts)
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    key = "dvla/run_dir"
    if rank == 0:
        try:
            run, resumed, previous = _choose_run_dir(cfg, restarts)
        except ConfigError as exc:
            store.set(key, json.dumps({"error": str(exc)}))
            raise
        store.set(key, json.dumps({"dir": str(run), "resumed": resumed}))
        return run, resumed, previous
    data = json.loads(store.get(key))
    if "error" in data:
        raise _RelayedError(data["error"])
    return Path(data["dir"]), bool(data["resumed"]), None


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


# -- errors ----------------------------------------------------------------------------------


def user_error(exc: BaseException) -> ConfigError | None:
    """The configuration error behind ``exc`` (itself, or what a lane raised), else None."""
    if isinstance(exc, ConfigError):
        return exc
    original = getattr(exc, "original", None)  # swimlane.LaneError
    if isinstance(original, ConfigError):
        return original
    return None


def lost_rank_line(exc: BaseException, rank: int) -> str:
    """One line for a rank whose job lost a peer (or failed): which rank, if the error
    names one, the first line of the error, and what to run next."""
    original = getattr(exc, "original", exc)
    first = " ".join((str(original).splitlines() or [""])[0].split()) or type(original).__name__
    named = re.search(r"\branks?(?:\(s\))?\s+((?:rank)?\d+(?:,\s*(?:rank)?\d+)*)", first)
    ranks = named.group(1).replace("rank", "") if named else ""
    lost = (f"rank {ranks} was lost" if "," not in ranks else f"ranks {ranks} were lost") if named \
        else "the job failed or lost a rank"
    return (f"dvla: error (rank {rank}): {lost}: {first[:300]}. Next: run the same command with --resume to "
            "continue from the last checkpoint (--debug shows the traceback)")


def preempted_line(lanes, summary: dict[str, Any]) -> str:
    """After a SIGTERM: where the run can be continued from."""
    ckpts = lanes.ckpt.list() if getattr(lanes, "ckpt", None) is not None else []
    where = f"checkpoint {ckpts[-1]}" if ckpts else "no checkpoint (nothing to resume)"
    return (f"stopped by SIGTERM at update {summary.get('version', 0)}: {where}; continue with --resume "
            f"(run.out_dir={Path(lanes.out_dir).parent})")


def _say_error(exc: BaseException, rank: int | None = None) -> None:
    msg = " ".join(str(exc).split())  # one line, whatever the message
    where = "" if not rank else f" (rank {rank})"
    print(f"dvla: error{where}: {msg}", file=sys.stderr, flush=True)


def see_own_gpu() -> None:
    """Under torchrun, narrow ``CUDA_VISIBLE_DEVICES`` to this rank's GPU before CUDA starts
    in the process, so that torch, simulators and renderers agree on one device, ``cuda:0``
    (memory/runtime.py). A ConfigError when the list names too few GPUs."""
    if "LOCAL_RANK" not in os.environ or os.environ.get("DVLA_VISIBLE_DEVICE_SET"):
        return
    from memory.runtime import visible_device_env

    try:
        os.environ.update(visible_device_env(int(os.environ["LOCAL_RANK"])))
    except ValueError as exc:
        raise ConfigError(f"CUDA_VISIBLE_DEVICES: {exc}") from None


def _abandon(code: int) -> NoReturn:
    """Leave a job whose peers may be gone: NCCL's communicators aborted (no barrier, no
    destroy that would wait for a dead peer), then exit at once."""
    try:
        shutdown(barrier=False) if uses_nccl() else None
    finally:
        os._exit(code)


def sft(argv: list[str]) -> int:
    """``dvla sft`` on the launcher (``torchrun ... -m dvla.launch sft --data ...``, and ``dvla
    sft``): each rank's GPU narrowed first (:func:`see_own_gpu`), then :func:`dvla.sft.main`
    joins the process group as a training run does."""
    try:
        see_own_gpu()
    except ConfigError as exc:
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
            print(f"dvla sft: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    from dvla.sft import main as sft_main

    return sft_main(argv)


def main(argv: list[str] | None = None, prog: str = "python -m dvla.launch") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sft"]:  # the supervised warm start, on the same launcher
        return sft(argv[1:])
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    try:
        see_own_gpu()  # first: nothing may start CUDA before
        args, cfg = parse_config(argv, prog)
    except ConfigError as exc:
        if "--debug" in argv:
            raise
        if local_rank == 0:  # every rank of a torchrun job parses the same command line: say it once
            _say_error(exc)
        return EXIT_USER_ERROR
    if args.verbose:
        os.environ["DVLA_VERBOSE"] = "1"  # simulators read it (e.g. genesis' repeated warnings)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    if args.print_rank:
        try:
            print(rank_plans(cfg, args.print_rank))
        except ConfigError as exc:
            _say_error(exc)
            return EXIT_USER_ERROR
        return 0
    return train(args, cfg)


def train(args, cfg) -> int:
    setup_logging(int(os.environ.get("RANK", "0") or 0), args.verbose)
    import swimlane

    if cfg.run.device.startswith("cuda") and not runtime.current().available():
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
            _say_error(ConfigError(f"run.device={cfg.run.device!r} but CUDA is not available on this machine "
                                   "(run.device=auto uses a GPU where there is one, else the CPU)"))
        return EXIT_USER_ERROR
    rank, world = init_from_env(timeout_s=cfg.swimlane.collective_timeout_s, device=cfg.run.device,
                                collective_backend=cfg.swimlane.collective_backend)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    stopped: list[bool] = []
    run_dir = previous = None
    resumed = False
    try:
        run_dir, resumed, previous = share_run_dir(cfg, rank, world, restarts)
        cfg.run.out_dir = str(run_dir)
        if world > 1 and cfg.run.device.startswith("cuda:") and cfg.run.device != "cuda:0":
            raise ConfigError(f"run.device: {cfg.run.device!r} under torchrun: each rank sees only its own GPU, "
                              "as cuda:0 (use auto or cuda)")
        if world > 1 and cfg.run.device in ("auto", "cuda") and runtime.current().available():
            cfg.run.device = "cuda:0"  # the rank's own GPU, the one it sees (see_own_gpu)
        lanes = swimlane.Swimlane(cfg, rank=rank, world_size=world)
        if rank == 0:
            log.info("run directory: %s%s", run_dir, " (continuing it)" if resumed else "")

        def on_sigterm(*_):  # a preemption (Slurm, Kubernetes), or torchrun stopping the group
            stopped.append(True)
            lanes.preempt()  # stop; rank 0's gradient lane checkpoints the current version on its way out

        signal.signal(signal.SIGTERM, on_sigterm)
        summary = lanes.run()
    except KeyboardInterrupt:
        print(f"dvla: interrupted{f'; partial results in {run_dir}' if run_dir is not None else ''}",
              file=sys.stderr, flush=True)
        if world == 1:
            return 130
        os._exit(130)
    except BaseException as exc:
        err = user_error(exc)
        if rank == 0 and run_dir is not None and not resumed:  # a new run that wrote nothing: gone
            from dvla.rundir import discard_new_run

            discard_new_run(run_dir.parent, run_dir, previous)
        if err is not None and not args.debug:
            if not isinstance(err, _RelayedError) or int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
                _say_error(err, rank if world > 1 and not isinstance(err, _RelayedError) else None)
            if world == 1:
                return EXIT_USER_ERROR
            sys.stdout.flush()
            _abandon(EXIT_USER_ERROR)  # peers may wait in a collective: no teardown barrier
        if world == 1:
            raise
        # A peer may be blocked in a collective that can never complete now: report in one
        # line (the traceback with --debug) and leave without the teardown barrier (torchrun
        # then stops the other ranks).
        if args.debug:
            traceback.print_exc()
        print(lost_rank_line(exc, rank), file=sys.stderr, flush=True)
        _abandon(1)
    if rank == 0:
        print(human_summary(summary, run_dir), flush=True)
        if stopped:
            print(preempted_line(lanes, summary), flush=True)
    if stopped and world > 1:
        # Stopped from outside: a peer may be gone, so no teardown barrier.
        sys.stdout.flush()
        _abandon(0)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
