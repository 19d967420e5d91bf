"""Command-line runs of dvla's entry points at a fraction of their start-up cost.

A test that runs ``python -m dvla.launch ...`` to see what a user sees (the exit code, stderr,
the files left) pays about 2 s of CPU before the first line of dvla runs: the interpreter
imports torch. :class:`Launcher` keeps one process per test worker that has imported torch
and dvla's entry points once and forks a child for every command: the child changes to the
command's directory, takes its environment, and runs the module as ``python -m`` would
(``runpy``, as ``__main__``, ``sys.argv`` and ``sys.path[0]`` set alike), with its own stdout and
stderr, signal handlers and exit code. What a fresh interpreter would do differently is only
what happens at import time: a test that is about imports (a foreign ``launch`` package on
``PYTHONPATH``, modules that must not be imported) or about environment variables read when a
module loads starts a real interpreter instead. The parent of the children runs nothing but
imports and forks (no torch op, no thread of its own), so forking it is safe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading

_SERVER = r'''
import json, os, runpy, sys, tempfile
import dvla.app.cli, dvla.app.train  # noqa: F401  (torch and the entry points, once)

def child(req):
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [req["cwd"], *extra, *BASE_PATH]
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(req[name], os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    sys.argv = [req["module"], *req["args"]]
    code = 0
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)

BASE_PATH = [p for p in sys.path if p not in ("", os.getcwd())]
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(req)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
'''


class Launcher:
    """``run(module, args, cwd=..., env=..., timeout=...)``: a ``subprocess.CompletedProcess``
    as ``subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True)``
    gives it (see the module's docstring for what differs). One command at a time; a command
    that runs past its timeout is killed and raises ``subprocess.TimeoutExpired``."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _server(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
            assert self._proc.stdout.readline().strip() == "ready", "the launcher did not start"
        return self._proc

    def run(self, module: str, args: list[str], *, cwd, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        with self._lock, tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            for path in (out, err):
                open(path, "w").close()
            server = self._server()
            server.stdin.write(json.dumps({"module": module, "args": [str(a) for a in args], "cwd": str(cwd),
                                           "env": dict(os.environ if env is None else env),
                                           "out": out, "err": err}) + "\n")
            server.stdin.flush()
            pid = json.loads(server.stdout.readline())["pid"]
            killed: list[int] = []
            timer = threading.Timer(timeout, lambda: (killed.append(pid), _kill(pid)))
            timer.start()
            try:
                line = server.stdout.readline()
            finally:
                timer.cancel()
            if not line:
                raise RuntimeError("the launcher process died")
            rc = json.loads(line)["rc"]
            stdout, stderr = open(out).read(), open(err).read()
        cmd = [sys.executable, "-m", module, *map(str, args)]
        if killed:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, rc, stdout, stderr)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        self._proc = None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
