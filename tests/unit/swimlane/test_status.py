"""Rank 0's live status endpoint (swimlane/observation/status.py): Prometheus rendering, the HTTP
handling against a real socket, and a live run read over HTTP from its ``on_update``."""

import json
import math
import re
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dvla.config import ConfigError, apply_overrides
from dvla.config.presets import debug
from swimlane import Swimlane
from swimlane.observation.status import PROMETHEUS, StatusServer, metric_name, prom_value, render_metrics, serve_status

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"'
SAMPLE = re.compile(rf"({NAME})(?:\{{((?:{LABEL},)*{LABEL})?\}})? (\S+)")
VALUE = re.compile(r"NaN|[+-]Inf|[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def parse_prometheus(text: str) -> dict[str, dict]:
    """Prometheus text format 0.0.4, strictly: each family's HELP and TYPE once, before its
    samples, which come together; valid names, labels, values; no series twice."""
    assert text.endswith("\n") and "\n\n" not in text
    families: dict[str, dict] = {}
    current = None
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            assert re.fullmatch(NAME, name) and name not in families, line
            families[name] = {"help": doc, "type": None, "samples": {}}
            current = name
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert name == current and families[name]["type"] is None and not families[name]["samples"], line
            assert kind in ("counter", "gauge", "untyped"), line
            families[name]["type"] = kind
        else:
            m = SAMPLE.fullmatch(line)
            assert m and m[1] == current and families[current]["type"], line
            labels = dict(re.findall(LABEL, m[2] or ""))
            assert len(labels) == len(re.findall(LABEL, m[2] or "")), f"a label twice: {line}"
            assert VALUE.fullmatch(m[7]), line
            key = frozenset(labels.items())
            assert key not in families[current]["samples"], f"a series twice: {line}"
            families[current]["samples"][key] = float(m[7])
    return families


def value(families: dict, name: str, **labels: str) -> float:
    return families[name]["samples"][frozenset({"rank": "0", **labels}.items())]


SNAP = {"rank": 0, "world_size": 1, "role": "learner+rollout", "version": 4, "iterations": 10, "progress": 0.4,
        "elapsed_s": 1.5, "env_steps": 256, "env_steps_per_s": 100.0,
        "lanes": {"gradient": True, "sampling": True}, "error": None, "stopping": False,
        "last": {"success_rate": 0.5}, "chunk_accounting": {"consumed": 4},
        "counters": {"chunks_consumed": 4, "dropped_stale": 1},
        "record": {"version": 4.0, "mem/persistent/reserved_mb": 1.25, "speed/rank2": 10.0, "speed/rank3": 20.0,
                   "loss": None, "hot": float("inf"), "down": float("-inf"), "odd key\n-é": float("nan"),
                   "flag": True, "text": "no"}}


# -- Prometheus rendering -------------------------------------------------------------------


def test_names_are_sanitised_and_values_written_as_prometheus_writes_them():
    assert metric_name("mem/persistent/bytes") == "dvla_mem_persistent_bytes"
    assert metric_name("a-b.c é:d") == "dvla_a_b_c__:d"
    assert re.fullmatch(NAME, metric_name("9 lives/€"))
    assert [prom_value(v) for v in (float("nan"), float("inf"), float("-inf"), None, 3, 2.5, 1e300)] == \
        ["NaN", "+Inf", "-Inf", "NaN", "3", "2.5", "1e+300"]


def test_render_has_help_type_and_a_rank_label_on_every_sample():
    text = render_metrics(SNAP)
    fams = parse_prometheus(text)
    assert value(fams, "dvla_up") == 1 and fams["dvla_up"]["type"] == "gauge"
    assert value(fams, "dvla_version") == 4.0 and value(fams, "dvla_mem_persistent_reserved_mb") == 1.25
    assert fams["dvla_chunks_consumed_total"]["type"] == "counter" and value(fams, "dvla_chunks_consumed_total") == 4
    assert value(fams, "dvla_dropped_stale_total") == 1
    # speed/rankN: one family, the rank it is about as a label beside the serving rank's.
    assert value(fams, "dvla_speed", of_rank="2") == 10.0 and value(fams, "dvla_speed", of_rank="3") == 20.0
    assert value(fams, "dvla_lane_alive", lane="gradient") == 1 and value(fams, "dvla_progress") == 0.4
    assert math.isnan(value(fams, "dvla_loss"))  # a record's None: a value that was not finite
    assert 'dvla_up{rank="0"} 1\n' in text and 'dvla_loss{rank="0"} NaN\n' in text
    odd = metric_name("odd key\n-é")
    assert re.fullmatch(NAME, odd) and math.isnan(value(fams, odd))
    assert "odd key\\n-é" in fams[odd]["help"]  # HELP escapes its newline
    assert "dvla_flag" not in fams and "dvla_text" not in fams  # only numbers
    assert all(dict(k).get("rank") == "0" for f in fams.values() for k in f["samples"])


def test_infinities_labels_escaped_and_clashes_kept_once():
    snap = {"rank": 3, "lanes": {'a"b\\c\nd': False},
            "record": {"hot": float("inf"), "down": float("-inf"), "a/b": 1.0, "a_b": 2.0, "up": 5.0}}
    text = render_metrics(snap)
    assert 'dvla_hot{rank="3"} +Inf\n' in text and 'dvla_down{rank="3"} -Inf\n' in text
    assert 'dvla_lane_alive{rank="3",lane="a\\"b\\\\c\\nd"} 0\n' in text
    fams = parse_prometheus(text)
    assert fams["dvla_a_b"]["samples"] == {frozenset({"rank": "3"}.items()): 1.0}  # the first one stays
    # dvla_up is the endpoint's own gauge: a record key "up" cannot replace it
    assert fams["dvla_up"]["samples"] == {frozenset({"rank": "3"}.items()): 1.0}


def test_the_strict_parser_refuses_malformed_text():
    good = "# HELP dvla_x x.\n# TYPE dvla_x gauge\ndvla_x{rank=\"0\"} 1\n"
    parse_prometheus(good)
    for bad in (good[:-1], good.replace("# TYPE dvla_x gauge\n", ""), good.replace(" 1\n", " nan\n"),
                good.replace("dvla_x{", "dvla-x{"), good + 'dvla_x{rank="0"} 2\n', good + good,
                good.replace('rank="0"', 'rank="0",rank="1"')):
        with pytest.raises(AssertionError):
            parse_prometheus(bad)


# -- HTTP -------------------------------------------------------------------------------------


def raw(addr: tuple[str, int], data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``data``, read to the server's close; (status, headers, body)."""
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 ")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert int(headers["Content-Length"]) == len(body) and headers["Connection"] == "close"
    return int(lines[0].split()[1]), headers, body


def get(addr, path: str) -> tuple[int, dict[str, str], bytes]:
    return raw(addr, f"GET {path} HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n".encode())


@pytest.fixture
def server():
    snap = dict(SNAP)
    srv = StatusServer(lambda: snap)
    addr = srv.start()
    yield srv, addr, snap
    srv.stop()


def test_get_endpoints_and_errors_and_the_server_keeps_serving(server):
    srv, addr, snap = server
    assert addr[0] == "127.0.0.1" and addr[1] > 0
    assert get(addr, "/healthz")[::2] == (200, b"ok\n")
    status, headers, body = get(addr, "/status?pretty=1")
    assert status == 200 and headers["Content-Type"] == "application/json"
    got = json.loads(body)
    assert got["version"] == 4 and got["healthy"] is True and "record" not in got and "counters" not in got
    status, headers, body = get(addr, "/metrics")
    assert status == 200 and headers["Content-Type"] == PROMETHEUS and parse_prometheus(body.decode())
    assert get(addr, "/nope")[0] == 404
    for method in ("POST", "HEAD", "DELETE"):
        status, headers, _ = raw(addr, f"{method} /status HTTP/1.1\r\n\r\n".encode())
        assert status == 405 and headers["Allow"] == "GET"
    for bad in (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n", b"\x00\xff\xfe garbage\r\n\r\n",
                b"GET /status\r\n\r\n", b"GET /status HTTP/2\r\n\r\n", b"get /status HTTP/1.1\r\n\r\n",
                b"GET /status HTTP/1.1\r\n" + b"X: y\r\n" * 100 + b"\r\n", b"\r\n"):
        assert raw(addr, bad)[0] == 400, bad[:40]
    assert get(addr, "/healthz")[0] == 200  # still serving


def test_an_idle_client_does_not_hold_up_others(server):
    _, addr, _ = server
    with socket.create_connection(addr, timeout=10) as idle:
        idle.sendall(b"GET /healthz HTT")  # and nothing more
        assert get(addr, "/healthz")[0] == 200


def test_healthz_says_why_the_run_is_not_healthy(server):
    _, addr, snap = server
    snap["lanes"] = {"gradient": True, "sampling": False}
    assert get(addr, "/healthz")[::2] == (503, b"lane(s) not running: sampling\n")
    snap["stopping"] = True
    assert get(addr, "/healthz")[::2] == (503, b"stopping\n")
    snap["error"] = "swimlane lane 'gradient' failed: RuntimeError: boom"
    status, _, body = get(addr, "/healthz")
    assert status == 503 and body == b"failed: swimlane lane 'gradient' failed: RuntimeError: boom\n"
    assert json.loads(get(addr, "/status")[2])["healthy"] is False


def test_a_failing_snapshot_is_a_500_and_the_server_goes_on():
    calls = []

    def snapshot():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return dict(SNAP)

    srv = StatusServer(snapshot)
    addr = srv.start()
    try:
        assert get(addr, "/status")[0] == 500 and get(addr, "/status")[0] == 200
    finally:
        srv.stop()


def test_stop_closes_the_port_and_ends_the_thread_and_a_taken_port_is_a_config_error():
    srv = StatusServer(lambda: SNAP)
    addr = srv.start()
    with pytest.raises(ConfigError, match=r"^run\.status_port: cannot serve .*127\.0\.0\.1:\d+"):
        StatusServer(lambda: SNAP, *addr).start()
    srv.stop()
    srv.stop()  # twice is fine
    assert not any(t.name == "dvla-status" for t in threading.enumerate())
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(addr, timeout=10).close()


def test_it_runs_on_uvloop_in_its_own_thread_even_from_inside_a_running_loop(monkeypatch, caplog):
    import asyncio
    import sys

    import uvloop

    from swimlane.observation import status

    async def from_a_notebook():  # a caller whose thread already runs an event loop
        srv = StatusServer(lambda: SNAP)
        return srv, srv.start()

    srv, addr = asyncio.run(from_a_notebook())
    try:
        assert isinstance(srv._loop, uvloop.Loop) and get(addr, "/healthz")[0] == 200
        assert srv._thread.daemon and srv._thread is not threading.current_thread()
    finally:
        srv.stop()
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not importable: asyncio's loop, said once at debug
    monkeypatch.setattr(status, "_warned", [])
    with caplog.at_level("DEBUG", logger="dvla.swimlane"):
        loops = [status.new_loop() for _ in range(2)]
    assert not any(isinstance(loop, uvloop.Loop) for loop in loops)
    assert [r.levelname for r in caplog.records if "uvloop" in r.message] == ["DEBUG"]
    for loop in loops:
        loop.close()


def test_a_client_that_sends_nothing_in_time_gets_408(monkeypatch, server):
    from swimlane.observation import status

    monkeypatch.setattr(status, "TIMEOUT_S", 0.2)
    _, addr, _ = server
    assert raw(addr, b"GET /healthz HTTP/1.1\r\n")[0] == 408  # headers never end


def test_connections_past_the_limit_get_503(monkeypatch, server):
    from swimlane.observation import status

    monkeypatch.setattr(status, "MAX_CONNECTIONS", 1)
    _, addr, _ = server
    with socket.create_connection(addr, timeout=10) as idle:
        idle.sendall(b"GET /healthz HTT")
        # The server takes connections in order: the idle one's handler counts first.
        assert get(addr, "/healthz")[::2] == (503, b"too many connections\n")


def test_only_rank_0_serves_and_only_when_asked():
    from types import SimpleNamespace

    def rank(r, cfg):  # what serve_status reads of a Swimlane
        return SimpleNamespace(cfg=cfg, state=SimpleNamespace(rank=r))

    assert serve_status(rank(1, apply_overrides(debug(), ["run.status_port=0"]))) is None
    assert serve_status(rank(0, debug())) is None


# -- a live run -------------------------------------------------------------------------------


def test_a_live_run_serves_its_status_over_http(tmp_path):
    seen: dict = {}

    def on_update(record):
        if record["version"] != 2:
            return
        # The gradient lane waits in this callback: version and counters stay as they are.
        seen["record"] = dict(record)
        seen["url"] = (tmp_path / "status_address").read_text()
        base = seen["url"].strip()
        for path in ("/healthz", "/status", "/metrics"):
            with urllib.request.urlopen(base + path, timeout=30) as r:
                seen[path] = (r.status, r.headers["Content-Type"], r.read().decode())
        try:
            urllib.request.urlopen(base + "/nope", timeout=30)
        except urllib.error.HTTPError as exc:
            seen["/nope"] = exc.code

    cfg = apply_overrides(debug(), [f"run.out_dir={tmp_path}", "run.iterations=3", "run.tensorboard=false",
                                    "run.status_port=0"])
    summary = Swimlane(cfg, on_update=on_update).run()
    assert summary["version"] == 3 and summary["error"] is None
    rec, url = seen["record"], seen["url"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+\n", url)
    assert seen["/healthz"] == (200, "text/plain; charset=utf-8", "ok\n") and seen["/nope"] == 404

    code, ctype, body = seen["/status"]
    st = json.loads(body)
    assert code == 200 and ctype == "application/json"
    assert (st["rank"], st["world_size"], st["role"], st["version"], st["iterations"]) == \
        (0, 1, "learner+rollout", 2, 3)
    assert st["progress"] == pytest.approx(2 / 3) and st["elapsed_s"] > 0 and st["healthy"] is True
    assert st["env_steps"] == rec["env_steps"] and st["env_steps_per_s"] == rec["env_steps_per_s"]
    assert st["lanes"] == dict.fromkeys(("gradient", "broadcast", "inference", "sampling"), True)
    assert st["last"] == {k: rec[k] for k in ("iter", "success_rate", "return_mean", "loss", "staleness_mean")}
    assert st["chunk_accounting"]["consumed"] == 2 and st["chunk_accounting"]["sent"] >= 2
    assert st["error"] is None and st["stopping"] is False

    code, ctype, body = seen["/metrics"]
    assert code == 200 and ctype == PROMETHEUS
    fams = parse_prometheus(body)
    assert value(fams, "dvla_version") == rec["version"] == 2 and value(fams, "dvla_up") == 1
    assert fams["dvla_chunks_consumed_total"]["type"] == "counter" and value(fams, "dvla_chunks_consumed_total") == 2
    assert value(fams, "dvla_chunks_sent_total") >= 2 and value(fams, "dvla_success_rate") == rec["success_rate"]
    assert value(fams, "dvla_speed", of_rank="0") == rec["speed/rank0"]
    assert value(fams, "dvla_mem_persistent_reserved_mb") == rec["mem/persistent/reserved_mb"]
    assert value(fams, "dvla_lane_alive", lane="gradient") == 1

    # After the run: nothing listens, no thread is left.
    port = int(url.strip().rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    assert not any(t.name == "dvla-status" for t in threading.enumerate())


def test_by_default_no_endpoint_and_no_address_file(tmp_path):
    threads: list[list[str]] = []
    cfg = apply_overrides(debug(), [f"run.out_dir={tmp_path}", "run.iterations=2", "run.tensorboard=false"])
    Swimlane(cfg, on_update=lambda r: threads.append([t.name for t in threading.enumerate()])).run()
    assert threads and not any("dvla-status" in names for names in threads)
    assert not (tmp_path / "status_address").exists()


def test_a_port_that_cannot_be_bound_stops_the_run_with_a_config_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = apply_overrides(debug(), [f"run.out_dir={tmp_path}", "run.tensorboard=false",
                                        f"run.status_port={port}"])
        lanes = Swimlane(cfg)
        with pytest.raises(ConfigError, match=rf"run\.status_port: cannot serve .*:{port}"):
            lanes.run()
    assert lanes.driver.threads and not any(t.is_alive() for t in lanes.driver.threads.values())
    assert not Path(tmp_path / "status_address").exists()
