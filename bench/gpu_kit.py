"""The GPU kit: dvla's CUDA paths on a borrowed GPU machine, in one call, with one verdict.

The machine this project borrows now and then (one H100 or H200, Python 3.12, torch 2.11 with
CUDA, no network) lacks pyzmq, which the swimlane's data plane imports. So:

    bench/gpu_kit.sh prepare [--wheels DIR]            here: the wheels the kit needs, checked
    bench/gpu_kit.sh run --out DIR [--wheels DIR]      there: install them, run the steps
    bench/gpu_kit.sh run --out DIR --cpu-rehearsal     here: every step's CPU half (CI runs it)

``prepare`` downloads the wheels (:data:`KIT_WHEELS`) for the lent machine's Python and
platform into ``DIR`` (default ``.gpu_kit/wheels``, ignored by git; at most 64 MiB, what one
call may carry), then checks offline that they install together (pip's dry run for that Python
and platform, from ``DIR`` alone) and that what the kit's steps import is either on the lent
machine (``bench/gpu_machine.txt``) or among the wheels.

``run`` installs the wheels into a folder of its own (not under ``--out``), then runs the steps
(:data:`STEPS`, most informative first), each under its own budget, all under one total of at
most :data:`TOTAL_BUDGET_S` seconds: the budgets add up to it by construction (checked at
import), and a step never gets more than what is left. Under ``--out`` it writes ``steps.log``
(every step's output, in sections), ``verdict.txt`` (the table it prints: step, passed or
failed, seconds, the first error line) and ``verdict.json``: three files, within what a lent
machine sends back. The exit status is the number of steps that failed.

A step's GPU half and CPU half run the same code paths where the CPU has them (the CPU
runtime, or the recording fake of the CUDA one); a step with no CPU half is ``skipped`` in a
rehearsal, as is a GPU half where no GPU is visible.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # (memory.runtime: the GPUs this machine shows)

TOTAL_BUDGET_S = 540  # one command on the lent machine may run 600 s: the rest is its start and transfers
INSTALL_BUDGET_S = 20
MAX_WHEELS_BYTES = 64 * 2**20  # what one call carries
KIT_WHEELS = ("pyzmq==27.3.0",)  # the version this project tests with; abi3, one wheel, libzmq inside
MACHINE_PYTHON = "3.12"
MACHINE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# What the kit's steps import, beyond the standard library (pip names).
KIT_IMPORTS = ("torch", "numpy", "pyzmq", "msgpack", "safetensors", "uvloop", "pyyaml", "tqdm", "matplotlib",
               "pytest", "pytest-xdist", "pytest-timeout", "transformers")
MIN_STEP_S = 1  # a step is started only with this much of the total left
LOG_CAP_BYTES = 256 * 1024  # per step, in steps.log (the tail is kept)


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: ``gpu`` runs on the lent machine, ``cpu`` in a rehearsal (None: no CPU
    half). ``{py}`` is the interpreter, ``{work}`` a scratch folder of the run. A step passes
    with exit status 0, or, where ``refusal`` is given, when it exits non-zero and its output
    holds that text (a refusal the step is there to see)."""

    name: str
    budget_s: int
    checks: str
    gpu: tuple[str, ...] | None
    cpu: tuple[str, ...] | None
    env: tuple[tuple[str, str], ...] = ()
    refusal: str | None = None


PY = "{py}"
PYTEST = (PY, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider")
LAUNCH = (PY, "-m", "dvla.launch", "--preset", "fast_reach", "run.progress=false", "swimlane.trace=false")
TORCHRUN = (PY, "-m", "torch.distributed.run", "--standalone")
PATHS = (PY, "bench/gpu_paths.py")

STEPS: tuple[Step, ...] = (
    Step("cuda-tests", 60, "the tests that need CUDA: memory pools and MemPools, lane streams and their priorities, "
         "pinned copies, the NCCL group bound to its GPU, the device runtime, a weight subscriber on a stream",
         (*PYTEST, "tests/unit/memory/test_memory.py", "tests/unit/swimlane/test_streams.py",
          "tests/unit/dvla/test_groups.py", "tests/unit/memory/test_device_runtime.py",
          "tests/integration/test_control_plane.py", "-k", "cuda or nccl"),
         (*PYTEST, "tests/unit/memory/test_device_runtime.py", "-k", "turns or brief or held or cuda_runtime"),
         env=(("CUDA_LAUNCH_BLOCKING", "0"),)),
    Step("colocated", 50, "one async rank with pools, streams and bf16 replicas: every version learned and "
         "published, the replica's weights as published, new batch shapes midway",
         (*PATHS, "colocated", "--device", "cuda", "--iterations", "12", "--envs", "64", "--image", "64"),
         (*PATHS, "colocated", "--device", "cpu", "--iterations", "6", "--envs", "16", "--image", "16")),
    Step("receiver", 60, "two processes on one GPU, learner and rollout rank: rank 1's replica holds the last "
         "version, its weights as published",
         (*PATHS, "receiver", "--device", "cuda", "--iterations", "8", "--envs", "64", "--image", "64"),
         (*PATHS, "receiver", "--device", "cpu", "--iterations", "3", "--envs", "8", "--image", "16")),
    Step("sync", 50, "sync mode, deterministic algorithms: serial and threaded drivers, streams on and off, "
         "bit-identical weights",
         (*PATHS, "sync", "--device", "cuda", "--iterations", "4", "--envs", "32", "--image", "32"),
         (*PATHS, "sync", "--device", "cpu", "--iterations", "2", "--envs", "8", "--image", "16")),
    Step("one-rank-group", 40, "a learner rank's collectives on a one-rank cpu:gloo,cuda:nccl group: publish, "
         "gradient all-reduce (masked too), small all-reduces, an FSDP2 bf16 learner with activation checkpointing, "
         "its checkpoint gathered from shards, shutdown and the abort path",
         (*TORCHRUN, "--nproc_per_node=1", "bench/gpu_paths.py", "group", "--device", "cuda", "--image", "64"),
         (*TORCHRUN, "--nproc_per_node=1", "bench/gpu_paths.py", "group", "--device", "cpu", "--image", "32")),
    Step("shared-gpu", 30, "two ranks on one GPU with the default backend: the one-line refusal, not NCCL's "
         "'Duplicate GPU detected'",
         (*TORCHRUN, "--nproc_per_node=2", "-m", "dvla.launch", "--preset", "fast_reach", "run.progress=false",
          "run.device=cuda", "run.iterations=2", "run.out_dir={work}/shared"),
         None, env=(("CUDA_VISIBLE_DEVICES", "0"),), refusal="would share one GPU"),
    Step("turns-pools", 40, "autotune and taking turns with memory pools: the sampling lane answers in the "
         "inference lane's pool",
         (*LAUNCH, "run.device=cuda", "run.iterations=8", "memory.enabled=true", "swimlane.cuda_streams=true",
          "swimlane.take_turns=true", "swimlane.autotune=true", "swimlane.autotune_window_s=0.5",
          "run.out_dir={work}/turns"),
         (*LAUNCH, "run.device=cpu", "run.iterations=3", "env.n_envs=8", "env.image_size=16", "memory.enabled=true",
          "swimlane.take_turns=true", "swimlane.autotune=true", "swimlane.autotune_window_s=0.5",
          "run.out_dir={work}/turns")),
    Step("memory", 30, "memory pools against the caching allocator under churn: peak reserved, fragmentation",
         (PY, "bench/memory_churn.py", "--iters", "300"), (PY, "bench/memory_churn.py", "--iters", "20")),
    Step("pools-budget", 40, "pools against the plain caching allocator near capacity "
         "(set_per_process_memory_fraction): reserved over 50 learner updates, OOMs, MemPools given back",
         (PY, "bench/pool_pressure.py", "--device", "cuda", "--fraction", "0.1", "--updates", "50"),
         (PY, "bench/pool_pressure.py", "--device", "cpu", "--updates", "4", "--hidden", "64", "--layers", "2",
          "--batch", "64")),
    Step("resume", 40, "a CPU run stopped by SIGTERM, resumed with --resume on the GPU: generator states "
         "across device types, every update accounted for",
         (*PATHS, "resume", "--device", "cuda", "--iterations", "6", "--envs", "16", "--image", "32"),
         (*PATHS, "resume", "--device", "cpu", "--iterations", "3", "--envs", "8", "--image", "16")),
    Step("figures", 70, "the first GPU figures: rollout decisions and learner updates per second of token_vla "
         "(0.5B) and pi0_vla (3B), bf16 against fp32",
         (PY, "bench/vla_speed.py", "--device", "cuda", "--size", "mid", "--batch", "32", "--samples", "16",
          "--repeats", "3"),
         (PY, "bench/vla_speed.py", "--device", "cpu", "--size", "tiny", "--batch", "4", "--samples", "4",
          "--repeats", "1")),
)

assert INSTALL_BUDGET_S + sum(s.budget_s for s in STEPS) <= TOTAL_BUDGET_S <= 540, "the kit's budgets overrun"
assert len({s.name for s in STEPS}) == len(STEPS)


# -- prepare (here) ---------------------------------------------------------------------------

def _pip(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout)


def _target_args(python: str) -> list[str]:
    abi = "cp" + python.replace(".", "")
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp", "--abi", abi]
    for p in MACHINE_PLATFORMS:
        args += ["--platform", p]
    return args


def machine_packages() -> set[str]:
    """The lent machine's Python packages (bench/gpu_machine.txt: one per line, as pip names them)."""
    names = set()
    for line in (ROOT / "bench" / "gpu_machine.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(re.split(r"[=<>! ]", line, maxsplit=1)[0].lower())
    return names


def prepare(args) -> int:
    wheels = Path(args.wheels)
    wheels.mkdir(parents=True, exist_ok=True)
    got = _pip("download", "-q", "-d", str(wheels), *_target_args(args.python_version), *KIT_WHEELS)
    if got.returncode != 0:
        print(f"prepare: pip download failed: {_first_error(got.stdout + got.stderr)}")
        return 1
    files = sorted(wheels.glob("*.whl"))
    size = sum(f.stat().st_size for f in files)
    print(f"prepare: {len(files)} wheel(s) in {wheels}, {size / 2**20:.1f} MiB (at most {MAX_WHEELS_BYTES // 2**20})")
    for f in files:
        print(f"  {f.name}")
    problems = []
    if size > MAX_WHEELS_BYTES:
        problems.append(f"the wheels take {size / 2**20:.1f} MiB, more than one call carries")
    with tempfile.TemporaryDirectory() as tmp:  # offline, from the wheels alone, for the lent machine
        report = Path(tmp) / "report.json"
        dry = _pip("install", "--dry-run", "--no-index", "--find-links", str(wheels), "--target", str(Path(tmp) / "t"),
                   "--report", str(report), *_target_args(args.python_version), *KIT_WHEELS)
        if dry.returncode != 0:
            problems.append(f"the dry run failed: {_first_error(dry.stdout + dry.stderr)}")
        else:
            installs = json.loads(report.read_text()).get("install", [])
            names = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in installs)
            print(f"prepare: dry run for Python {args.python_version} on {MACHINE_PLATFORMS[0]}, offline: "
                  f"installs {', '.join(names)}")
    have = machine_packages() | {w.split("==")[0].lower() for w in KIT_WHEELS}
    missing = [n for n in KIT_IMPORTS if n.lower() not in have]
    if missing:
        problems.append(f"the kit imports {', '.join(missing)}, neither on the lent machine nor among the wheels")
    for p in problems:
        print(f"prepare: FAIL {p}")
    if not problems:
        print(f"prepare: OK; carry {wheels.relative_to(ROOT) if wheels.is_relative_to(ROOT) else wheels} with "
              "the call (docs/large-models.md)")
    return 1 if problems else 0


# -- run (there, or a rehearsal here) ---------------------------------------------------------

_ERROR = re.compile(r"(^E\s|Error\b|error:|\bFAIL\b|FAILED|Traceback|Killed|refus|timed out)")


def _first_error(text: str) -> str:
    """The line that says what went wrong: pytest's first ``E`` line, an exception, a FAIL;
    else the last line printed."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("E ") or re.search(r"\b\w+(Error|Exception)\b:", ln) or " FAIL " in f" {ln} ":
            return ln[:200]
    for ln in lines:
        if _ERROR.search(ln):
            return ln[:200]
    return lines[-1][:200] if lines else ""


def _install(wheels: Path | None, site: Path, log) -> dict:
    """Every wheel in ``wheels`` into ``site`` (offline, no dependencies: the set is complete)."""
    t0 = time.monotonic()
    files = sorted(wheels.glob("*.whl")) if wheels is not None else []
    if not files:
        return {"step": "install", "result": "skipped", "seconds": 0.0,
                "error": "no wheels given: the interpreter's own packages"}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
           *map(str, files)]
    rc, out, timed_out = _run(cmd, dict(os.environ), INSTALL_BUDGET_S)
    log("install", cmd, out)
    ok = rc == 0 and not timed_out
    names = ", ".join(f.name.split("-")[0] + " " + f.name.split("-")[1] for f in files)
    return {"step": "install", "result": "passed" if ok else "timed out" if timed_out else "failed",
            "seconds": round(time.monotonic() - t0, 1), "error": f"installed {names}" if ok else _first_error(out)}


def _run(cmd: list[str], env: dict, limit: float) -> tuple[int, str, bool]:
    """Run ``cmd`` in a session of its own; past ``limit`` its whole process group gets
    SIGINT, then SIGKILL 5 s later."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(limit, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, grace in ((signal.SIGINT, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        out.seek(0)
        return proc.returncode if proc.returncode is not None else -9, out.read(), timed_out


def _gpus() -> int:
    try:
        from memory import runtime  # (torch's import: no torch, no step can run anyway)
    except ImportError:
        return 0
    return runtime.current().device_count()


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = min(args.budget, TOTAL_BUDGET_S)
    gpus = _gpus()  # (torch's import: a few seconds before the budget starts, within the call's margin)
    deadline = time.monotonic() + budget
    rehearsal = args.cpu_rehearsal
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {s.name for s in STEPS}
    if unknown:
        print(f"gpu_kit: --only: no step {', '.join(sorted(unknown))} (steps: {', '.join(s.name for s in STEPS)})")
        return 2
    work = Path(tempfile.mkdtemp(prefix="dvla-gpu-kit-"))
    site = work / "site"
    log_path = out / "steps.log"
    log_file = log_path.open("w")

    def log(name: str, cmd: list[str], text: str) -> None:
        data = text.encode()
        if len(data) > LOG_CAP_BYTES:
            text = "[... " + str(len(data) - LOG_CAP_BYTES) + " bytes cut ...]\n" + data[-LOG_CAP_BYTES:].decode(
                errors="replace")
        log_file.write(f"== {name}: {' '.join(cmd)}\n{text}\n")
        log_file.flush()

    head = {"commit": _commit(), "mode": "cpu rehearsal" if rehearsal else "gpu", "gpus": gpus,
            "python": sys.version.split()[0], "torch": _torch_version(), "budget_s": budget}
    rows = [_install(Path(args.wheels) if args.wheels else None, site, log)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site) if site.exists() else "", str(ROOT),
                                                    env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    for step in STEPS:
        if only is not None and step.name not in only:
            continue
        argv = step.cpu if rehearsal else step.gpu
        left = deadline - time.monotonic()
        why = None
        if argv is None:
            why = "no CPU half" if rehearsal else "no GPU half"
        elif not rehearsal and gpus == 0:
            why = "no CUDA device visible"
        elif left < MIN_STEP_S:
            why = "the kit's total budget is spent"
        if why is not None:
            rows.append({"step": step.name, "result": "skipped" if left >= MIN_STEP_S else "not run", "seconds": 0.0,
                         "error": why})
            continue
        cmd = [a.replace("{py}", sys.executable).replace("{work}", str(work)) for a in argv]
        step_env = {**env, **dict(step.env)}
        t0 = time.monotonic()
        rc, text, timed_out = _run(cmd, step_env, min(step.budget_s, left))
        seconds = round(time.monotonic() - t0, 1)
        log(step.name, cmd, text + f"\n== {step.name}: exit {rc} after {seconds} s")
        if step.refusal is not None:
            ok = not timed_out and rc != 0 and step.refusal in text
            error = "" if ok else (f"no refusal ({step.refusal!r}) in its output, exit {rc}: " + _first_error(text))
        else:
            ok = rc == 0 and not timed_out
            error = "" if ok else _first_error(text)
        if timed_out:
            error = f"timed out after {seconds} s (budget {step.budget_s} s); " + _first_error(text)
        rows.append({"step": step.name, "result": "passed" if ok else "timed out" if timed_out else "failed",
                     "seconds": seconds, "error": error[:200]})
    log_file.close()
    shutil.rmtree(work, ignore_errors=True)
    table = verdict_table(head, rows)
    (out / "verdict.txt").write_text(table)
    (out / "verdict.json").write_text(json.dumps({**head, "steps": rows}, indent=2))
    print(table, end="")
    return sum(r["result"] in FAILED for r in rows)


FAILED = ("failed", "timed out", "not run")  # what the exit status counts


def verdict_table(head: dict, rows: list[dict]) -> str:
    lines = [f"dvla gpu kit, commit {head['commit']}, {head['mode']}, python {head['python']}, torch {head['torch']}, "
             f"{head['gpus']} GPU(s), total budget {head['budget_s']} s",
             "| step | result | seconds | first error line (or a note) |", "| --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['result']} | {r['seconds']:.1f} | {r['error'].replace('|', '/')} |")
    failed = sum(r["result"] in FAILED for r in rows)
    lines.append(f"{failed} step(s) failed or not run, {sum(r['result'] == 'passed' for r in rows)} passed, "
                 f"{sum(r['seconds'] for r in rows):.0f} s in all")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    got = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return got.stdout.strip() or "?"


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return "none"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_kit.sh", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="download and check the wheels the kit carries (here)")
    p.add_argument("--wheels", default=str(ROOT / ".gpu_kit" / "wheels"))
    p.add_argument("--python-version", default=MACHINE_PYTHON, help="the lent machine's Python")
    r = sub.add_parser("run", help="install the wheels and run the steps (there; --cpu-rehearsal here)")
    r.add_argument("--out", required=True, help="where steps.log, verdict.txt and verdict.json go")
    r.add_argument("--wheels", default=None, help="the prepared wheels (default on a GPU: .gpu_kit/wheels if "
                   "there; a rehearsal installs only wheels it is given, for its own Python)")
    r.add_argument("--cpu-rehearsal", action="store_true", help="every step's CPU half")
    r.add_argument("--only", default="", help="the steps to run, comma-separated")
    r.add_argument("--budget", type=int, default=TOTAL_BUDGET_S, help=f"total seconds (at most {TOTAL_BUDGET_S})")
    args = ap.parse_args(argv)
    if args.command == "prepare":
        return prepare(args)
    if args.wheels is None and not args.cpu_rehearsal and (ROOT / ".gpu_kit" / "wheels").is_dir():
        args.wheels = str(ROOT / ".gpu_kit" / "wheels")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
