"""A learner no chunk can poison: every malformation is rejected with a reason and
counted, the weights stay finite, and in sync mode on a fixed seed they end equal to a run
that never saw the poison. A non-finite loss skips its steps and is counted; weights that
are not finite are never published."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dvla.config import apply_overrides
from dvla.config.presets import debug
from dvla.types import RolloutBatch
from tests.helpers.ranks import rewire
from swimlane import LaneError, Swimlane
from swimlane.lanes.channels import Chunk
from swimlane.lanes.validate import ChunkSpec, check_chunk

SYNC = ["swimlane.mode=sync", "swimlane.driver=serial", "swimlane.env_groups=1", "swimlane.max_staleness=0",
        "run.iterations=4"]


def cfg_for(tmp_path, name, *overrides):
    return apply_overrides(debug(), [f"run.out_dir={tmp_path / name}", *SYNC, *overrides])


def _along_t(b: RolloutBatch) -> RolloutBatch:
    """One step more than an episode may have."""
    per_env = {"success", "group_ids", "instruction_ids", "instruction_mask"}
    return RolloutBatch.from_dict({k: (v if k in per_env else torch.cat([v, v[:1]])) for k, v in b.to_dict().items()})


def _set(name, fn):
    def poison(b: RolloutBatch) -> RolloutBatch:
        t = getattr(b, name).clone()
        return dataclasses.replace(b, **{name: fn(t)})
    return poison


def _write(t, value):
    t.view(-1)[0] = value
    return t


POISONS = {
    "proprio width": ("shape", _set("proprio", lambda t: t[..., :-1])),
    "image size": ("shape", _set("image", lambda t: t[..., :-2, :])),
    "action dim": ("shape", _set("actions", lambda t: torch.cat([t, t[..., :1]], dim=-1))),
    "action chunk": ("shape", _set("actions", lambda t: torch.cat([t, t[:, :, :1]], dim=2))),
    "episode length": ("shape", _along_t),
    "envs per chunk": ("shape", lambda b: RolloutBatch.from_dict({
        k: v[:-1] if k in ("success", "group_ids", "instruction_ids", "instruction_mask") else v[:, :-1] for k, v in b.to_dict().items()})),
    "instruction id past the vocabulary": ("instruction_ids", _set("instruction_ids", lambda t: _write(t, 10**6))),
    "negative instruction id": ("instruction_ids", _set("instruction_ids", lambda t: _write(t, -3))),
    "NaN reward": ("non_finite", _set("rewards", lambda t: _write(t, float("nan")))),
    "inf log-prob": ("non_finite", _set("log_probs", lambda t: _write(t, float("-inf")))),
    "NaN value": ("non_finite", _set("values", lambda t: _write(t, float("nan")))),
    "version from the future": ("version", _set("policy_version", lambda t: t + 1)),
    "negative version": ("version", _set("policy_version", lambda t: t - 100)),
}


class Poisoner:
    """A chunk channel that delivers a poisoned copy of every chunk before the chunk (or,
    with ``replace``, instead of it)."""

    def __init__(self, inner, poison, replace: bool = False):
        self.inner, self.poison, self.replace, self.sent = inner, poison, replace, 0

    def put(self, chunk: Chunk, stop=None) -> bool:
        self.sent += 1
        if self.replace:
            return self.inner.put(Chunk(self.poison(chunk.batch), chunk.meta, chunk.on_done), stop)
        return (self.inner.put(Chunk(self.poison(chunk.batch), {"rank": "mallory"}, None), stop)
                and self.inner.put(chunk, stop))

    def __getattr__(self, name):  # get, depth, end, close
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    lanes = Swimlane(cfg_for(tmp_path_factory.mktemp("clean"), "run"))
    return lanes.run()


@pytest.mark.parametrize("what", list(POISONS))
def test_a_poisoned_chunk_is_rejected_counted_and_changes_nothing(tmp_path, clean, what):
    reason, poison = POISONS[what]
    lanes = Swimlane(cfg_for(tmp_path, "run"))
    chunks = Poisoner(lanes.parts.source, poison)
    rewire(lanes, sink=chunks, source=chunks)
    summary = lanes.run()
    assert summary["version"] == 4 and chunks.sent == 4
    assert summary[f"rejected_{reason}"] == 4, summary
    assert sum(v for k, v in summary.items() if k.startswith("rejected_")) == 4
    assert all(bool(torch.isfinite(p).all()) for p in lanes.policy.parameters())
    assert summary["weights_digest"] == clean["weights_digest"]  # as if the poison never came


def test_check_chunk_accepts_what_the_rollouts_send(tmp_path):
    lanes = Swimlane(cfg_for(tmp_path, "run", "run.iterations=1"))
    got = []

    class Spy(Poisoner):
        def put(self, chunk, stop=None):
            got.append(chunk.batch)
            return self.inner.put(chunk, stop)

    chunks = Spy(lanes.parts.source, None)
    rewire(lanes, sink=chunks, source=chunks)
    lanes.run()
    spec = ChunkSpec.for_policy(lanes.policy, lanes.cfg.env.n_envs, lanes.cfg.env.episode_len)
    assert got and all(check_chunk(b, spec, learner_version=0) is None for b in got)
    assert check_chunk(got[0], spec, learner_version=-1)[0] == "version"


def test_non_finite_updates_are_skipped_counted_and_stop_the_run(tmp_path, monkeypatch):
    """Finite but huge rewards overflow PPO's returns: every step of those updates is
    skipped, the weights stay as they were, and after ``max_bad_updates`` in a row the run
    stops with a report. (The learner's range checks reject such rewards first, issue #38,
    tests/unit/planes/test_trust.py; they are switched off here to reach the update's own guard.)"""
    monkeypatch.setattr("swimlane.lanes.validate.check_ranges", lambda tensors, spec: None)
    lanes = Swimlane(cfg_for(tmp_path, "run", "algo.name=ppo", "policy.options.value_head=true",
                             "swimlane.max_bad_updates=2"))
    before = {k: v.clone() for k, v in lanes.policy.state_dict().items()}
    huge = _set("rewards", lambda t: torch.full_like(t, 3e38))
    chunks = Poisoner(lanes.parts.source, huge, replace=True)
    rewire(lanes, sink=chunks, source=chunks)
    with pytest.raises(LaneError, match=r"2 updates in a row had a non-finite loss or gradient"):
        lanes.run()
    assert lanes.counters["updates_non_finite"] == 2
    for k, v in lanes.policy.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_weights_that_are_not_finite_are_never_published(tmp_path):
    lanes = Swimlane(cfg_for(tmp_path, "run", "swimlane.driver=threads"))
    with torch.no_grad():
        next(lanes.policy.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(LaneError, match="the weights of version 0 hold NaN or inf: not published"):
        lanes.run()
    assert lanes.parts.weights.latest_version < 0 and lanes.counters["publishes"] == 0


def test_an_update_that_overflows_the_distribution_is_never_published(tmp_path):
    """Finite weights can still make the policy's distribution NaN: an update whose first
    optimizer step leaves the action head's biases 3e38 apart (finite, so the snapshot's own
    check passes; their softmax is not) stops the run before its version is published or
    checkpointed, and what was published before stays."""
    lanes = Swimlane(cfg_for(tmp_path, "run", "run.save_every=1"))
    step, poisoned = lanes.algo.optimizer.step, []

    def diverging(*args, **kwargs):
        out = step(*args, **kwargs)
        if lanes.counters["publishes"] == 2 and not poisoned:  # in the update from version 1
            with torch.no_grad():
                bias = lanes.policy.action_head.bias
                bias[0::2], bias[1::2] = 3e38, -3e38
            poisoned.append(True)
        return out

    lanes.algo.optimizer.step = diverging
    with pytest.raises(LaneError, match=r"the update from version 1 made the policy's action distribution NaN or inf"):
        lanes.run()
    assert poisoned and torch.isfinite(lanes.policy.action_head.bias).all()
    assert lanes.counters["publishes"] == 2 and lanes.parts.weights.latest_version == 1
    saved = [int(p.name.split("-")[1]) for p in lanes.parts.checkpoints.manager.list()]
    assert saved and max(saved) <= 1, saved
