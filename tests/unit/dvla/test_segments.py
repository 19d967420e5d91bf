"""PPO segments (swimlane.segment_len): chunks of T decisions of every env across its resets,
GAE hand-checked across a reset and at the segment's end, exact episode statistics, an
instruction change, the config's checks and a run that learns."""

import dataclasses

import pytest
import torch

from dvla.algos.losses import gae
from dvla.config import ConfigError, EnvConfig, apply_overrides
from dvla.envs.base import BatchedEnv, EnvSpec
from dvla.metrics import read_metrics
from dvla.policy import ActOutput
from dvla.config.presets import fast_reach
from dvla.rollout import episode_stats
from dvla.rollout.segments import SegmentRecorder
from dvla.types import Observation
from swimlane import Swimlane
from swimlane.lanes.validate import ChunkSpec, check_chunk


class Line(BatchedEnv):
    """x counts the decisions of an episode; reward x after the step; V(x) = 10 x + 1 below.
    ``terminate_at``: x that ends an episode successfully (None: only the time limit)."""

    spec = EnvSpec(image_shape=(3, 2, 2), proprio_dim=1, action_dim=1)
    terminate_at = None
    episodes = 0

    def _reset(self, group_size):
        self.x = torch.zeros(self.n_envs)
        self.names = [self.instruction() for _ in range(self.n_envs)]

    def _reset_envs(self, envs, group_size):
        self.x[envs] = 0.0
        for i in envs.tolist():
            self.names[i] = self.instruction()

    def instruction(self):
        return "go"

    def _step_action(self, a):
        self.x = self.x + 1.0
        term = self.x >= self.terminate_at if self.terminate_at else torch.zeros(self.n_envs, dtype=torch.bool)
        return self.x.clone(), term, torch.zeros_like(term), term

    def _observe(self):
        return Observation(image=torch.zeros(self.n_envs, 3, 2, 2, dtype=torch.uint8),
                           proprio=self.x.unsqueeze(1).clone(), instruction=list(self.names))


def prepare(obs: Observation) -> Observation:
    ids = torch.tensor([[hash(s) % 97 + 1, 1] for s in obs.instruction]) if obs.instruction_ids is None \
        else obs.instruction_ids
    return dataclasses.replace(obs, instruction_ids=ids, instruction_mask=ids != 0)


def value(obs: Observation):
    return obs.proprio[:, 0] * 10 + 1


def act(rec: SegmentRecorder) -> ActOutput:
    obs = rec.request_obs()
    return ActOutput(actions=torch.zeros(obs.batch_size, 1, 1), log_probs=torch.zeros(obs.batch_size),
                     values=value(obs))


def run(env, rec, steps):
    chunks = []
    for _ in range(steps):
        out = act(rec)
        rec.record(out, env.step(out.actions[:env.n_envs]), version=0)
        while rec.ready:
            chunks.append(rec.pop()[0])
    return chunks


def line(n=1, episode_len=3, segment_len=4, env_cls=Line):
    env = env_cls(EnvConfig(name="line", n_envs=n, episode_len=episode_len))
    rec = SegmentRecorder(env.spec, n, 1, segment_len, prepare=prepare)
    rec.begin(prepare(env.reset(1, independent=True, final_obs=True)))
    return env, rec


def test_gae_runs_across_a_reset_inside_a_segment_and_bootstraps_at_its_end():
    """Segment of 4 decisions, episodes of 3 (time limit): the column holds episode 1 (cut
    by the limit: bootstraps from V(x=3) = 31) and the first decision of episode 2 (cut by
    the segment's end: bootstraps from the next observation's value, V(x=1) = 11)."""
    env, rec = line()
    chunks = run(env, rec, 4)
    assert not chunks and rec.full and rec.owes_values  # the tail value comes with the next request
    env.terminate_at = 2.0  # episode 2 terminates (success) at x = 2
    chunks = run(env, rec, 1)
    assert len(chunks) == 1 and not rec.owes_values
    c = chunks[0]
    assert c.rewards[:, 0].tolist() == [1.0, 2.0, 3.0, 1.0]
    assert c.truncated[:, 0].tolist() == [False, False, True, False] and not c.terminated.any()
    assert c.valid.all()
    assert c.values[:, 0].tolist() == [1.0, 11.0, 21.0, 1.0, 11.0]
    assert c.bootstrap[:, 0].tolist() == [0.0, 0.0, 31.0, 0.0]
    g, lam = 0.9, 0.8
    adv, ret = gae(c.rewards, c.values, c.terminated, c.terminated | c.truncated, g, lam, c.bootstrap)
    d = [1 + g * 11 - 1, 2 + g * 21 - 11, 3 + g * 31 - 21, 1 + g * 11 - 1]
    hand = [d[0] + g * lam * (d[1] + g * lam * d[2]), d[1] + g * lam * d[2], d[2], d[3]]
    assert adv[:, 0].tolist() == pytest.approx(hand)
    assert ret[:, 0].tolist() == pytest.approx([h + v for h, v in zip(hand, [1.0, 11.0, 21.0, 1.0])])
    # without the bootstrap field, the truncation would take the next episode's first value
    wrong, _ = gae(c.rewards, c.values, c.terminated, c.terminated | c.truncated, g, lam)
    assert wrong[2, 0] == pytest.approx(3 + g * 1 - 21)
    # episode statistics: episode 1 ended here (return 6, 3 decisions, no success)
    assert c.episode_sums[0].tolist() == [1.0, 0.0, 6.0, 3.0]
    # episode 2 began in the first chunk and ends in the second: counted there, whole
    chunks = run(env, rec, 3)
    assert len(chunks) == 0
    env.terminate_at = None
    chunks = run(env, rec, 1)
    second = chunks[0]
    assert second.terminated[0, 0] and second.episode_sums[0, :2].tolist() == [2.0, 2.0]
    assert second.episode_sums[0, 2:].tolist() == [1.0 + 2.0 + 1.0 + 2.0, 2.0 + 2.0]  # two episodes of x = 1, 2
    assert episode_stats(second) == {"episodes": 2.0, "success_rate": 1.0, "return_mean": 3.0,
                                     "episode_len_mean": 2.0}
    spec = ChunkSpec(image_shape=(3, 2, 2), proprio_dim=1, action_dim=1, action_chunk=1, n_envs=1, max_steps=4)
    assert check_chunk(second, spec, learner_version=0) is None


def test_a_value_request_completes_a_full_chunk():
    """When the group may not open the next chunk, a value-only request (the envs' rows, then
    the truncated episodes') completes the full one; acting later opens the next."""
    env, rec = line(n=2, episode_len=2, segment_len=2)
    run(env, rec, 2)  # both episodes truncated at the segment's last step: only their bootstraps owed
    assert rec.full and rec.owes_values and len(rec.pending) == 2 and rec.tails is None
    obs = rec.request_obs()
    assert obs.batch_size == 4
    rec.fill(value(obs))
    assert rec.ready and not rec.owes_values
    c = rec.pop()[0]
    assert c.bootstrap[1].tolist() == [21.0, 21.0] and c.episode_sums[:, 0].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="values for 2 envs"):
        rec.fill(torch.zeros(3))
    assert len(run(env, rec, 2)) == 0 and rec.owes_values  # the next chunk opened and filled


class Alternating(Line):
    """Every new episode's instruction alternates."""

    def instruction(self):
        self.episodes += 1
        return f"task {self.episodes % 2}"


def test_an_env_whose_new_episode_has_another_instruction_leaves_its_column():
    env, rec = line(n=1, episode_len=3, segment_len=4, env_cls=Alternating)
    first_ids = rec.ids.clone()
    idle = 0
    for _ in range(4):
        out = act(rec)
        idle += rec.record(out, env.step(out.actions[:1]), version=0)[1]
    assert idle == 1  # after the first episode, the rest of the segment is not recorded
    out = act(rec)
    rec.record(out, env.step(out.actions[:1]), version=0)
    c = rec.pop()[0]
    assert c.valid[:, 0].tolist() == [True, True, True, False]
    assert torch.equal(c.instruction_ids, first_ids) and c.bootstrap[2, 0] == 31.0
    assert c.episode_sums[0].tolist() == [1.0, 0.0, 6.0, 3.0]
    assert not torch.equal(rec.chunks[0].t["instruction_ids"], first_ids)  # the next chunk: the new one


def test_segments_need_ppo_and_independent_envs():
    with pytest.raises(ConfigError, match="segment_len.*independent_envs"):
        apply_overrides(fast_reach(), ["swimlane.segment_len=8"]).validate()
    with pytest.raises(ConfigError, match="segments need algo.name=ppo"):
        apply_overrides(fast_reach(), ["swimlane.segment_len=8", "swimlane.independent_envs=true",
                                       "swimlane.max_staleness=2"]).validate()
    with pytest.raises(ConfigError, match="segment_len: must be >= 0"):
        apply_overrides(fast_reach(), ["swimlane.segment_len=-1"]).validate()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_on_segments_learns_fast_reach(tmp_path, mode):
    """PPO on segments of 8 decisions (episodes up to 12): no env idles, and learning rises."""
    lanes = Swimlane(apply_overrides(fast_reach(), [
        "swimlane.independent_envs=true", "swimlane.segment_len=8", f"swimlane.mode={mode}",
        "swimlane.max_staleness=2", "algo.name=ppo", "policy.options.value_head=true",
        "run.iterations=40", "env.image_size=16", "env.n_envs=32", "swimlane.env_groups=2",
        "run.torch_threads=1", "run.progress=false", f"run.out_dir={tmp_path / 'run'}"]))
    summary = lanes.run()
    assert summary["version"] == 40 and summary["env_steps_idle"] == 0
    assert not any(v for k, v in summary["totals"].items() if k.startswith("rejected_"))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    success = [r["success_rate"] for r in rows[2:] if r["success_rate"] is not None]
    first, last = sum(success[:8]) / 8, sum(success[-8:]) / 8
    assert last > first + 0.12, (first, last)
