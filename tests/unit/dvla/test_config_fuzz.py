"""Every config field and every env option against what an unlucky operator types (issue #47,
5): NaN, infinities, huge and negative numbers, wrong types. Each value is accepted, or is a
one-line ConfigError naming the field; an accepted value of the fast env's options and of the
reward and learning-rate fields also runs, to its end or its time limit, without hanging."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dvla.app.train import parse_config
from dvla.config import ConfigError, JobConfig
from dvla.envs.fast import FastReachEnv
from dvla.envs.genesis_env import GenesisFrankaEnv
from dvla.envs.libero_env import LiberoEnv

NASTY = [".nan", ".inf", "-.inf", "1e300", "-1e300", "-1", "0", "1180591620717411303424", "0.5", "text", "[1, 2]",
         "{a: 1}", "true", "null", "''"]
FIELDS = [(f"{s.name}.{f.name}", "debug") for s in dataclasses.fields(JobConfig())
          for f in dataclasses.fields(getattr(JobConfig(), s.name))]
OPTIONS = ([(f"env.options.{k}", "debug") for k in FastReachEnv.OPTIONS]
           + [(f"env.options.{k}", "genesis_reach") for k in GenesisFrankaEnv.OPTIONS]
           + [(f"env.options.{k}", "libero_spatial") for k in LiberoEnv.OPTIONS])
RUNNABLE = [p for p, preset in OPTIONS if preset == "debug"] + ["env.success_reward", "env.reward_shaping", "algo.lr"]


def _parse(path: str, preset: str, value: str, *more: str):
    """The job config, or the ConfigError's one line."""
    try:
        return parse_config(["--preset", preset, f"{path}={value}", *more])[1]
    except ConfigError as exc:
        text = str(exc)
        assert text and "\n" not in text, (path, value, text)
        return text


def test_the_fuzz_covers_every_field_and_every_shipped_option():
    assert len(FIELDS) > 100 and {"algo.lr", "env.options", "run.status_host", "memory.transient_budget"} <= \
        {p for p, _ in FIELDS}
    assert {"env.options.render_cost_ms", "env.options.dt", "env.options.task_ids"} <= {p for p, _ in OPTIONS}


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(FIELDS + OPTIONS), st.sampled_from(NASTY))
def test_a_bad_value_anywhere_is_accepted_or_one_line(where, value):
    _parse(*where, value)


@pytest.mark.parametrize("path, value, message", [
    ("env.options.radius", ".nan", "env.options.radius: must be a finite number in (0, 2], got nan"),
    ("env.options.long_tail", ".inf", "env.options.long_tail: must be a finite number in [0, 100], got inf"),
    ("env.options.max_delta", ".nan", "env.options.max_delta: must be a finite number in (0, 1], got nan"),
    ("env.options.render_wait_ms", ".inf", "env.options.render_wait_ms: must be a finite number in [0, 1000]"),
    ("env.options.render_cost_ms", "1.0e+300", "env.options.render_cost_ms: must be a finite number in [0, 1000]"),
    ("env.success_reward", "1e300", "env.success_reward: must be in [0, 1000000.0]"),
    ("env.reward_shaping", "1e300", "env.reward_shaping: must be in [0, 1000000.0]"),
    ("algo.lr", "1e38", "algo.lr: must be in (0, 1"),
    ("algo.lr", "1e30", "algo.lr: must be in (0, 1"),
])
def test_the_values_that_slipped_through_are_refused(path, value, message):
    """What issue #47 found accepted (or ending in a traceback, or a hang)."""
    got = _parse(path, "debug", value)
    assert isinstance(got, str) and message in got, got


@pytest.mark.slow
@settings(max_examples=24, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                  HealthCheck.function_scoped_fixture])
@given(st.sampled_from(RUNNABLE), st.sampled_from(NASTY + ["1000", "1e6", "1.0"]))
def test_an_accepted_value_runs_without_hanging(tmp_path, path, value):
    from swimlane import Swimlane

    cfg = _parse(path, "debug", value, "run.iterations=2", "run.time_limit_s=20", "run.tensorboard=false",
                 f"run.out_dir={tmp_path}")
    if isinstance(cfg, str):
        return
    result: list = []

    def run():
        try:
            result.append(Swimlane(cfg).run())
        except ConfigError as exc:  # a mistake found once the job is built: one line too
            result.append(str(exc))
        except BaseException as exc:
            result.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), f"{path}={value}: the run hangs"
    got = result[0]
    assert isinstance(got, dict) or (isinstance(got, str) and "\n" not in got), (path, value, got)
