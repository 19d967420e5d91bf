"""Lane streams (swimlane/lanes/streams.py): on the CPU a no-op the swimlane runs through; on CUDA
the inference lane's forward passes, on a stream of their own while a learner updates on
another, give the actions they give alone, and weights written into a standby replica are
complete when the inference lane switches to it."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from dvla.algos import build_algorithm
from dvla.config import AlgoConfig
from dvla.envs import make_env
from dvla.policy import PolicySpec, build_policy
from dvla.config.presets import debug
from dvla.rollout import collect_episodes
from planes.buckets import flat_buckets
from swimlane.lanes.streams import LaneStream, tensors_of
from swimlane.lanes.weights import DoubleBufferedWeights

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_lane_streams_are_a_no_op_on_the_cpu():
    s = LaneStream(torch.device("cpu"), enabled=True, high_priority=True)
    assert s.stream is None
    t = torch.ones(3)
    with s.use():
        t.add_(1)
    s.hand_over([t])  # nothing to mark on the CPU
    assert torch.equal(t, torch.full((3,), 2.0))
    assert not s.can_prioritise and not s.high_priority  # no priority knob for autotune here
    with pytest.raises(OSError, match="CUDA stream"):
        s.set_high_priority(True)


@cuda
def test_cuda_inference_stream_priority_switches_between_blocks():
    """swimlane.adaptation.autotune's inference_priority knob: the next block runs on a stream of the
    highest or the lowest priority, and a result made on either is the same."""
    device = torch.device("cuda")
    s = LaneStream(device, high_priority=True)
    lo, hi = torch.cuda.Stream.priority_range()
    if lo == hi:
        pytest.skip("this GPU has one stream priority")
    assert s.can_prioritise and s.high_priority and s.stream.priority == hi
    x = torch.arange(1000.0, device=device)
    with s.use():
        high = (x * 2).sum()
    s.set_high_priority(False)
    assert not s.high_priority and s.stream.priority == lo
    with s.use():
        assert torch.cuda.current_stream(device) == s.stream
        low = (x * 2).sum()
    assert torch.equal(high, low)
    s.set_high_priority(True)
    assert s.stream.priority == hi


def _policy_and_batch(device):
    cfg = debug()
    env = make_env(cfg.env, "cpu", seed=0)
    torch.manual_seed(0)
    policy = build_policy("tiny_vla", PolicySpec.for_env(env.spec), cfg.policy.options)
    batch = collect_episodes(env, policy, 6, group_size=4, generator=torch.Generator().manual_seed(0))
    obs = env.reset()
    return policy.to(device), batch, policy.prepare(obs)


@cuda
def test_cuda_inference_on_its_stream_beside_a_learner_gives_the_same_actions():
    device = torch.device("cuda")
    policy, batch, obs = _policy_and_batch(device)
    replica = copy.deepcopy(policy).requires_grad_(False)
    algo = build_algorithm(AlgoConfig(name="grpo", group_size=4, lr=1e-3), policy)
    alone = [replica.act(obs, generator=torch.Generator(device).manual_seed(i)).actions.cpu() for i in range(20)]
    s_inf, s_learn = LaneStream(device, high_priority=True), LaneStream(device)
    assert s_inf.stream is not None and s_inf.stream != s_learn.stream
    got = []

    def infer() -> None:
        for i in range(20):
            with s_inf.use():
                out = replica.act(obs, generator=torch.Generator(device).manual_seed(i))
            s_inf.hand_over(tensors_of(out))
            got.append(out.actions.cpu())

    t = threading.Thread(target=infer)
    t.start()
    for i in range(5):
        with s_learn.use():
            algo.update(batch, torch.Generator().manual_seed(i))
    t.join()
    assert all(torch.equal(a, b) for a, b in zip(alone, got)) and len(got) == 20


@cuda
def test_cuda_a_committed_replica_is_complete_for_a_reader_on_another_stream():
    device = torch.device("cuda")
    policy, _, obs = _policy_and_batch(device)
    replicas = [copy.deepcopy(policy).requires_grad_(False) for _ in range(2)]
    weights = DoubleBufferedWeights(replicas, [flat_buckets(r) for r in replicas])
    new = [torch.randn_like(f) for f in flat_buckets(copy.deepcopy(policy))]
    reader = LaneStream(device, high_priority=True)
    for version in range(1, 6):
        src = [f * version for f in new]
        weights.write(version, src)  # non-blocking copies on this thread's stream, then commit
        with reader.use():
            replica, v = weights.acquire()
            seen = [f.clone() for f in weights.flats[weights.replicas.index(replica)]]
        assert v == version and all(torch.equal(a, b) for a, b in zip(seen, src))


def _record(device, alloc=None, steps=5, b=6):
    """A batch recorded from synthetic steps (episodes ending at random), with every tensor
    the recorder takes on ``device``; the same on every device."""
    from dvla.envs.base import EnvSpec
    from dvla.policy import ActOutput
    from dvla.rollout import EpisodeRecorder
    from dvla.types import Observation, StepResult

    class Spec:
        n_envs, spec = b, EnvSpec((3, 4, 4), 2, 2)

    g = torch.Generator().manual_seed(0)

    def obs():
        return Observation(image=torch.randint(0, 255, (b, 3, 4, 4), dtype=torch.uint8, generator=g).to(device),
                           proprio=torch.randn(b, 2, generator=g).to(device),
                           instruction_ids=torch.ones(b, 2, dtype=torch.long, device=device),
                           instruction_mask=torch.ones(b, 2, dtype=torch.bool, device=device))

    rec = EpisodeRecorder(Spec(), action_chunk=2, episode_len=steps, alloc=alloc)
    rec.start(obs())
    while not rec.finished:
        actions, elements = torch.randn(b, 2, 2, generator=g), torch.randn(b, 2, 2, generator=g)
        ends = torch.rand(b, generator=g) < 0.3
        res = StepResult(obs=obs(), reward=torch.rand(b, generator=g).to(device), terminated=ends.to(device),
                         truncated=torch.zeros(b, dtype=torch.bool, device=device),
                         success=ends.to(device), executed=torch.randint(1, 3, (b,), generator=g).to(device))
        rec.record(ActOutput(actions.to(device), elements.sum((1, 2)).to(device), torch.randn(b, generator=g).to(device),
                             elements.to(device)), res, version=1)
    return rec.build(torch.arange(b)).to_dict()


@cuda
def test_cuda_rollout_copies_into_pinned_buffers_without_waiting_and_record_the_same_batch():
    from memory import TransientPool

    pool = TransientPool("cpu", name="transient_host", pin_memory=True)
    lease = pool.lease()
    on_gpu = _record(torch.device("cuda"), alloc=lease.empty, steps=5)
    on_cpu = _record(torch.device("cpu"), steps=5)
    assert lease.empty((4,), torch.float32).is_pinned()
    # The GPU run may take one step more (its all-done flag lags): a step with every episode
    # over, invalid, so the batches agree on every valid step.
    valid = on_cpu["valid"]
    assert torch.equal(on_gpu["valid"], valid)
    for k, v in on_cpu.items():
        got = on_gpu[k]
        assert got.shape == v.shape, k
        if v.dim() >= 2 and v.shape[1] == valid.shape[1] and v.shape[0] in (len(valid), len(valid) + 1):
            got, v = got[: len(valid)][valid], v[: len(valid)][valid]
        assert torch.equal(got, v), k


def test_a_lane_stream_takes_the_ends_of_the_devices_priority_range():
    """The priority range differs by GPU ((0, -1) on many, (0, -5) on Hopper): a high-priority
    lane stream is made at the range's most urgent end and a low one at its other end, as the
    runtime reports them (the recording fake, with a Hopper-like range), and the autotune knob
    moves between the two."""
    from tests.helpers.fake_runtime import FakeRuntime, installed

    class Hopper(FakeRuntime):
        def priority_range(self) -> tuple[int, int]:
            return 0, -5

    with installed(Hopper()):
        high = LaneStream(torch.device("cpu"), high_priority=True)
        low = LaneStream(torch.device("cpu"))
        assert high.can_prioritise and high.high_priority and high.stream.name == "lane-5"
        assert low.can_prioritise and not low.high_priority and low.stream.name == "lane0"
        low.set_high_priority(True)
        assert low.high_priority and low.stream.name == "lane-5"
        low.set_high_priority(False)
        assert not low.high_priority and low.stream.name == "lane0"
    with installed(FakeRuntime()):  # (0, -1): one step apart, still the two ends
        assert LaneStream(torch.device("cpu"), high_priority=True).stream.name == "lane-1"
