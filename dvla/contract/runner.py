"""The policy contract: what dvla needs of a :class:`~dvla.policy.VLAPolicy`, checked in the
modes dvla runs it in, each check saying what failed and what to do.

    dvla check-policy --import my_vla.py policy.name=my_vla policy.options.width=16

or, in a model's own tests::

    from dvla.contract import assert_policy_contract

    def test_my_vla_keeps_the_contract():
        assert_policy_contract("my_vla", options={"width": 16})

dvla samples (rollouts, inference replicas) and learns (``algo.train_mode=false``, the
default) with the policy in eval mode, so the checks run it in eval mode: dropout is off.
The inference replicas are deep copies, published in bf16 where ``swimlane.publish_dtype``
says so and run under bf16 autocast (``VLAPolicy._autocast``); the learner scores their
actions in fp32, and the ``bf16`` check reports the gap between the two.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dvla.contract.checks import (BATCH_TOLERANCE, BF16_TOLERANCE, CHECKS, DEFAULT_SPEC, LOGP_TOLERANCE, Check,
                                  Context, Failed, make_obs)
from dvla.policy import PolicySpec, VLAPolicy

_TORCH_DIR = str(Path(torch.__file__).parent)


@dataclass
class CheckResult:
    name: str
    status: str  # "pass", "FAIL" or "skip"
    detail: str = ""  # what was measured, or what failed
    fix: str = ""  # what to do (failures)
    measured: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        text = f"{self.status:<4}  {self.name:<18} {self.detail}"
        return f"{text}. Fix: {self.fix}" if self.status == "FAIL" and self.fix else text


@dataclass
class Report:
    policy: str
    spec: PolicySpec
    results: list[CheckResult]

    @property
    def ok(self) -> bool:
        return all(r.status != "FAIL" for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "FAIL"]

    def __getitem__(self, name: str) -> CheckResult:
        return next(r for r in self.results if r.name == name)

    def summary(self) -> str:
        bad = self.failures
        if not bad:
            return f"{self.policy}: every check passed"
        skipped = sum(r.status == "skip" for r in self.results)
        return (f"{self.policy}: {len(bad)} of {len(self.results)} checks failed ({', '.join(r.name for r in bad)})"
                + (f", {skipped} skipped" if skipped else ""))

    def __str__(self) -> str:
        return "\n".join([self.summary(), *(f"  {r.line()}" for r in self.results)])


def _run(check: Check, c: Context) -> CheckResult:
    try:
        got = check.fn(c)
    except Failed as exc:
        return CheckResult(check.name, "FAIL", str(exc), exc.fix or check.fix)
    except Exception as exc:  # the model's code: say where
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
        where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
        msg = " ".join(str(exc).split())
        return CheckResult(check.name, "FAIL", f"raised {type(exc).__name__}: {msg}{where}", check.fix)
    detail, measured = got if isinstance(got, tuple) else (got or "", {})
    return CheckResult(check.name, "pass", detail, measured=measured)


def check_policy(policy: str | type[VLAPolicy] | VLAPolicy, spec: PolicySpec | None = None,
                 options: dict[str, Any] | None = None, *, batch: int = 4, seed: int = 0,
                 device: str | torch.device = "cpu", entropy_samples: int = 256) -> Report:
    """Run the contract's checks on ``policy`` (a registered name, a VLAPolicy subclass with
    ``options`` for its Config, or a built instance, whose weights are then checked) acting in
    ``spec`` (default :data:`DEFAULT_SPEC`). Each check passes, fails (what failed and what to
    do) or is skipped (a check it needs failed); nothing is raised."""
    if isinstance(policy, VLAPolicy):
        spec = spec or policy.spec
    if batch < 2:
        raise ValueError(f"batch must be >= 2 (rows alone vs a batch), got {batch}")
    c = Context(policy, spec or DEFAULT_SPEC, dict(options or {}), batch, seed, device, entropy_samples)
    name = policy if isinstance(policy, str) else getattr(policy, "registry_name", None) or (
        policy.__qualname__ if isinstance(policy, type) else type(policy).__qualname__)
    results: dict[str, CheckResult] = {}
    for check in CHECKS:
        missing = [n for n in check.needs if results[n].status != "pass"]
        results[check.name] = (CheckResult(check.name, "skip", f"needs {', '.join(missing)}") if missing
                               else _run(check, c))
    return Report(str(name), c.spec, list(results.values()))


def assert_policy_contract(policy: str | type[VLAPolicy] | VLAPolicy, spec: PolicySpec | None = None,
                           options: dict[str, Any] | None = None, **kwargs: Any) -> Report:
    """:func:`check_policy`, raising one AssertionError that lists every failed check (what
    failed, what to do): for a model's own tests."""
    report = check_policy(policy, spec, options, **kwargs)
    if not report.ok:
        raise AssertionError("\n".join([report.summary(), *(f"  {r.line()}" for r in report.failures)]))
    return report


__all__ = ["check_policy", "assert_policy_contract", "Report", "CheckResult", "DEFAULT_SPEC", "BF16_TOLERANCE",
           "BATCH_TOLERANCE", "LOGP_TOLERANCE", "make_obs"]
