"""Rank 0's live status endpoint: ``GET /healthz``, ``/status`` (JSON) and ``/metrics``
(Prometheus's text format 0.0.4), with ``run.status_port``.

The one event loop in dvla (uvloop's): many idle connections and no CPU work, served from a
daemon thread of its own, never a lane's. It reads the run through ``snapshot()``, a function
returning a plain dict, taken under no lock, so a client never blocks or slows a lane. Every
read is bounded (line length, header count, time, connections); each connection gets one
response and is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import threading
import time
from http import HTTPStatus
from typing import Any, Callable

from dvla.config import ConfigError

log = logging.getLogger("dvla.swimlane")
MAX_LINE = 8192  # bytes of the request line, and of each header line
MAX_HEADERS = 64
TIMEOUT_S = 5.0  # to send a request, and to take the response
MAX_CONNECTIONS = 64
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
_TEXT, _JSON = "text/plain; charset=utf-8", "application/json"
_PER_RANK = re.compile(r"(.+)/rank(\d+)")  # metrics keys about one rank: speed/rank2 -> dvla_speed{of_rank="2"}
_warned: list[bool] = []


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's; asyncio's default one (said once, at debug) where uvloop cannot be imported."""
    try:
        import uvloop
    except ImportError:
        if not _warned:
            _warned.append(True)
            log.debug("uvloop not importable: the status endpoint runs on asyncio's default event loop")
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def metric_name(key: str) -> str:
    """``mem/persistent/bytes`` -> ``dvla_mem_persistent_bytes`` ([a-zA-Z_:][a-zA-Z0-9_:]*)."""
    return "dvla_" + re.sub(r"[^a-zA-Z0-9_:]", "_", key)


def prom_value(v: Any) -> str:
    """A sample value as Prometheus writes it; None (a record's non-finite number) is NaN."""
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    v = float("nan") if v is None else float(v)
    return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf") if math.isinf(v) else repr(v)


def _escape(s: str, quote: bool) -> str:
    s = s.replace("\\", "\\\\").replace("\n", "\\n")
    return s.replace('"', '\\"') if quote else s


def render_metrics(snap: dict[str, Any]) -> str:
    """The snapshot's latest metrics record (gauges), ledger counters (``_total``) and
    lane states, one ``rank`` label on every sample."""
    families: dict[str, tuple[str, str, dict[tuple, str]]] = {}  # name -> (type, help, {labels: value})

    def add(name: str, kind: str, text: str, value: Any, **labels: str) -> None:
        fam = families.setdefault(name, (kind, text, {}))
        key = tuple({"rank": str(snap.get("rank", 0)), **labels}.items())
        if fam[0] == kind and key not in fam[2]:  # a clash after sanitising: the first one stays
            fam[2][key] = prom_value(value)

    add("dvla_up", "gauge", "1 while the run's status endpoint serves.", 1)
    add("dvla_progress", "gauge", "Learner updates made, as a fraction of run.iterations.", snap.get("progress"))
    add("dvla_elapsed_seconds", "gauge", "Seconds since the run started.", snap.get("elapsed_s"))
    for lane, alive in snap.get("lanes", {}).items():
        add("dvla_lane_alive", "gauge", "1 while the lane's thread runs.", int(alive), lane=lane)
    for key, v in snap.get("record", {}).items():
        if v is None or isinstance(v, (int, float)) and not isinstance(v, bool):
            m = _PER_RANK.fullmatch(key)
            add(metric_name(m[1] if m else key), "gauge", f"metrics.jsonl's {m[1] + '/rank<N>' if m else key} "
                "in the latest learner update's record.", v, **({"of_rank": m[2]} if m else {}))
    for reason, v in snap.get("data_plane_rejected", {}).items():
        add("dvla_data_plane_rejected_total", "counter", "Messages the data plane's receiver refused, by reason "
            "(planes.identity, planes.receiver).", v, reason=reason)
    for key, v in snap.get("counters", {}).items():
        add(metric_name(key) + "_total", "counter", f"The run's {key} counter (swimlane.observation.ledger).", v)
    out = []
    for name, (kind, text, samples) in families.items():
        out += [f"# HELP {name} {_escape(text, False)}", f"# TYPE {name} {kind}"]
        for labels, value in samples.items():
            pairs = ",".join(f'{k}="{_escape(v, True)}"' for k, v in labels)
            out.append(f"{name}{{{pairs}}} {value}")
    return "\n".join(out) + "\n"


def problem(snap: dict[str, Any]) -> str | None:
    """Why the run is not healthy, or None."""
    down = [lane for lane, alive in snap.get("lanes", {}).items() if not alive]
    return (f"failed: {snap['error']}" if snap.get("error") else "stopping" if snap.get("stopping")
            else "starting" if not snap.get("lanes") else f"lane(s) not running: {', '.join(down)}" if down else None)


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return {k: _finite(v) for k, v in x.items()} if isinstance(x, dict) else x


class StatusServer:
    def __init__(self, snapshot: Callable[[], dict[str, Any]], host: str = "127.0.0.1", port: int = 0):
        self.snapshot, self.host, self.port = snapshot, host, port
        self.connections, self._server, self._loop, self._thread = 0, None, None, None
        self._error: BaseException | str = "not bound within 60 s"

    def start(self) -> tuple[str, int]:
        """Bind and serve from a daemon thread (its loop is its own: a caller inside a running
        loop, a notebook's, is fine); returns the bound ``(host, port)``. A port that cannot be
        bound is a :class:`ConfigError`."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="dvla-status", daemon=True)
        self._thread.start()
        ready.wait(60.0)
        if self._server is None:
            self._thread.join(5.0)  # it is ending
            self._thread = None
            raise ConfigError(f"run.status_port: cannot serve the status endpoint on {self.host}:{self.port} "
                              f"(run.status_host): {getattr(self._error, 'strerror', None) or self._error}")
        return self._server.sockets[0].getsockname()[:2]

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listening socket and every connection; wait at most ``timeout`` for the thread."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop already ended
            self._loop.call_soon_threadsafe(self._server.close)
            self._loop.call_soon_threadsafe(self._loop.stop)
        thread.join(timeout)
        if thread.is_alive():
            log.warning("the status endpoint's thread did not end within %.0f s; leaving it (a daemon)", timeout)

    def _serve(self, ready: threading.Event) -> None:
        loop = self._loop = new_loop()
        asyncio.set_event_loop(loop)
        try:
            try:
                self._server = loop.run_until_complete(asyncio.start_server(
                    self._handle, self.host, self.port, limit=MAX_LINE, backlog=MAX_CONNECTIONS))
            except Exception as exc:  # an address in use, a host that does not resolve, ...
                self._error = exc
                return
            finally:
                ready.set()
            loop.run_forever()
        finally:
            for task in (tasks := asyncio.all_tasks(loop)):
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        status, ctype, body, extra = 503, _TEXT, "too many connections\n", ""
        try:
            if self.connections <= MAX_CONNECTIONS:
                try:
                    status, ctype, body, extra = self._respond(*await asyncio.wait_for(_request(reader), TIMEOUT_S))
                except asyncio.TimeoutError:
                    status, body = 408, "request not received in time\n"
                except ValueError as exc:  # a line past MAX_LINE, not ASCII, not HTTP/1.x
                    status, body = 400, f"bad request: {exc}\n"
            data = body.encode()
            writer.write(f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {ctype}\r\nContent-Length: "
                         f"{len(data)}\r\n{extra}Connection: close\r\n\r\n".encode("latin-1") + data)
            await asyncio.wait_for(writer.drain(), TIMEOUT_S)
            if writer.can_write_eof():  # a close with unread input resets: the client would lose the answer
                writer.write_eof()
                await asyncio.wait_for(reader.read(16 * MAX_LINE), 0.5)
        except (OSError, asyncio.TimeoutError):
            pass  # the client went away or stalled
        finally:
            self.connections -= 1
            writer.close()

    def _respond(self, method: str, path: str) -> tuple[int, str, str, str]:
        if path not in ("/healthz", "/status", "/metrics"):
            return 404, _TEXT, f"not found: {path} (GET /healthz, /status, /metrics)\n", ""
        if method != "GET":
            return 405, _TEXT, f"method not allowed: {method}\n", "Allow: GET\r\n"
        try:
            snap = self.snapshot()
        except Exception as exc:  # an endpoint never takes the run down
            return 500, _TEXT, f"snapshot failed: {exc!r}\n", ""
        if path == "/metrics":
            return 200, PROMETHEUS, render_metrics(snap), ""
        if path == "/healthz":
            why = problem(snap)
            return (503, _TEXT, f"{why}\n", "") if why else (200, _TEXT, "ok\n", "")
        status = {k: v for k, v in snap.items() if k not in ("record", "counters")}
        return 200, _JSON, json.dumps(_finite({**status, "healthy": problem(snap) is None}), indent=1) + "\n", ""


async def _request(reader: asyncio.StreamReader) -> tuple[str, str]:
    """``(method, path)`` of one HTTP/1.x request; its headers read and ignored."""
    parts = (await reader.readline()).decode("ascii").split()  # ValueError past MAX_LINE
    if len(parts) != 3 or not re.fullmatch(r"[A-Z]+", parts[0]) or not parts[1].startswith("/") \
            or not parts[2].startswith("HTTP/1."):
        raise ValueError("expected 'METHOD /path HTTP/1.x'")
    for _ in range(MAX_HEADERS):
        if (await reader.readline()).strip() == b"":
            return parts[0], parts[1].split("?")[0]
    raise ValueError(f"more than {MAX_HEADERS} header lines")


def run_snapshot(swim: Any) -> dict[str, Any]:
    """What rank 0's :class:`swimlane.Swimlane` shows, read without a lock (each value may be one
    update old)."""
    s = swim.state
    rec = s.history[-1] if s.history else {}
    try:
        acc = swim.updates.chunk_accounting()
    except RuntimeError:  # a receiver's dict changed while read: the next request reads it again
        acc = None
    errors = list(swim.errors)
    return {"rank": s.rank, "world_size": s.world_size, "role": swim.plan.role,
            "version": s.version, "iterations": s.iterations, "progress": s.version / s.iterations,
            "elapsed_s": time.perf_counter() - s.start_time,
            "env_steps": int(rec.get("env_steps") or s.ledger.carried_env_steps),
            "env_steps_per_s": rec.get("env_steps_per_s"),
            "lanes": {name: t.is_alive() for name, t in list(swim.driver.threads.items())},
            "error": str(errors[0]).splitlines()[0] if errors else None,
            "stopping": s.stop_event.is_set() or s.rollout_stop.is_set(),
            "last": {k: rec.get(k) for k in ("iter", "success_rate", "return_mean", "loss", "staleness_mean")},
            "chunk_accounting": acc, "data_plane_rejected": _plane_rejections(swim),
            "counters": s.ledger.totals(), "record": dict(rec)}


def _plane_rejections(swim: Any) -> dict[str, int]:
    """What this rank's data-plane receiver refused, by reason ({} without one)."""
    receiver = getattr(getattr(swim.parts, "source", None), "receiver", None)
    return dict(receiver.counters.rejected) if receiver is not None else {}


def serve_status(swim: Any) -> StatusServer | None:
    """Rank 0 with ``run.status_port`` >= 0: serve, log the address and write it to
    ``RUN_DIR/status_address``."""
    run = swim.cfg.run
    if swim.state.rank != 0 or run.status_port < 0:
        return None
    server = StatusServer(lambda: run_snapshot(swim), run.status_host, run.status_port)
    host, port = server.start()
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    log.info("status: %s/status", url)
    try:  # whole or absent for a script polling it
        tmp = swim.out_dir / f".status_address.{os.getpid()}"
        tmp.write_text(url + "\n")
        os.replace(tmp, swim.out_dir / "status_address")
    except BaseException:
        server.stop()
        raise
    return server
