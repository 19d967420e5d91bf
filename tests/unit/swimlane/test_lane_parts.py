"""The swimlane's plain parts, without threads: the ledger and chunk accounting, the
health checks, and admission by weights version."""

import pytest

from swimlane.lanes.admission import Admission
from swimlane.observation.health import FailureBudget, StallTimer, dead_senders
from swimlane.observation.ledger import COUNTERS, Ledger, chunk_accounting


def test_ledger_counts_and_carries_totals_across_a_resume():
    led = Ledger()
    led.add("chunks_sent")
    led.add("env_steps_sampled", 40)
    assert led["chunks_sent"] == 1 and led["env_steps_sampled"] == 40
    with pytest.raises(KeyError, match="unknown counter 'chunk_sent'"):
        led.add("chunk_sent")
    led.carry({"chunks_sent": 5, "env_steps_sampled": 100}, env_steps=96)  # an older checkpoint
    totals = led.totals()
    assert totals["chunks_sent"] == 6 and totals["env_steps_sampled"] == 140 and totals["publishes"] == 0
    assert led.carried_env_steps == 96 and set(totals) == set(COUNTERS)
    assert set(COUNTERS.values()) <= {"sampling", "gradient", "broadcast"}  # one writing lane each


def test_chunk_accounting_in_one_process_and_across_senders():
    counts = {**dict.fromkeys(COUNTERS, 0), "chunks_sent": 9, "chunks_consumed": 6, "dropped_stale": 2,
              "discarded_after_run": 1}
    local = chunk_accounting(counts, local=True)
    assert local["sent"] == 9 and local["received"] == 9 and local["unaccounted"] == 0
    # Sender a ended (said 5), b died after 4 (3 arrived), c is alive with 2 not yet arrived.
    counts = {**counts, "chunks_consumed": 7, "dropped_stale": 1, "discarded_after_run": 0}
    acc = chunk_accounting(counts, local=False, invalid=1, ended={"a": 5}, reported={"b": 4, "c": 3},
                           received={"a": 5, "b": 3, "c": 1}, dead=["b"], expected=["a", "b", "c"])
    assert acc["sent"] == 12 and acc["received"] == 9
    assert acc["lost_dead_peer"] == 1 and acc["in_flight_at_exit"] == 2 and acc["unaccounted"] == 0
    # A mismatch between what arrived and what was counted shows as unaccounted.
    live = chunk_accounting(counts, local=False, invalid=1, ended={"a": 12}, received={"a": 9}, expected=["a"])
    assert live["in_flight_at_exit"] == 3 and live["unaccounted"] == 0
    off = chunk_accounting(counts, local=False, invalid=0, ended={"a": 12}, received={"a": 9}, expected=["a"])
    assert off["unaccounted"] == 1


def test_stall_timer_counts_only_progress():
    now = [100.0]
    timer = StallTimer(5.0, clock=lambda: now[0])
    now[0] = 104.0
    assert timer.stalled_for() is None
    now[0] = 105.5
    assert timer.stalled_for() == pytest.approx(5.5)
    timer.progress()
    now[0] = 108.0
    assert timer.stalled_for() is None
    off = StallTimer(0.0, clock=lambda: now[0])
    now[0] = 1e9
    assert off.stalled_for() is None


def test_failure_budget_is_per_group_and_consecutive():
    budget = FailureBudget(groups=2, limit=3)
    assert not budget.failed(0) and not budget.failed(0)
    budget.succeeded(0)  # a good step resets the count
    assert not budget.failed(0) and not budget.failed(1) and not budget.failed(0)
    assert budget.failed(0)  # third in a row
    assert budget.in_a_row == [3, 1]


def test_dead_senders_are_those_silent_before_ending():
    assert dead_senders(["h:1", "h:2", "h:3"], ended=["h:2"], dead_peers=["h:2", "h:3", "x:9"]) == ["h:3"]


def test_admission_waits_for_weights_the_learner_will_accept():
    # One sender feeds a learner that takes 2 chunks per update: each batch is half a version.
    adm = Admission(base=0, chunks_per_update=2, senders=1, max_staleness=1)
    assert adm.admits(0)
    needs = []
    for _ in range(6):
        needs.append(adm.needed())
        adm.start()
    assert needs == [-1, -1, 0, 0, 1, 1]
    assert adm.needed() == 2 and not adm.admits(1) and adm.admits(2)  # 6 batches: version 3, minus 1
    # an episode joining a chunk that leaves after two more (independent envs) needs newer weights
    assert adm.needed(ahead=2) == 3 and not adm.admits(2, ahead=2) and adm.admits(3, ahead=2)
    two = Admission(base=0, chunks_per_update=1, senders=2, max_staleness=0)  # each batch: 2 versions
    two.start()
    assert two.needed() == 2
    resumed = Admission(base=7, chunks_per_update=4, senders=1, max_staleness=0)
    assert resumed.needed() == 7
    with pytest.raises(ValueError, match="senders must be >= 1"):
        Admission(base=0, chunks_per_update=1, senders=0, max_staleness=1)


def _lanes_on_fast_reach(mode="async", groups=2, turns=None):
    """A sampling and an inference lane joined by plain queues, on the pure-torch env."""
    import copy
    import threading

    import torch

    from dvla.config import EnvConfig
    from dvla.envs import make_env
    from dvla.policy import PolicySpec, build_policy
    from planes.buckets import flat_buckets
    from swimlane.lanes.channels import LocalChannel
    from swimlane.lanes.chunks import LocalChunks
    from swimlane.lanes import InferenceLane, SamplingConfig, SamplingLane
    from swimlane.observation.trace import Tracer
    from swimlane.lanes.weights import DoubleBufferedWeights

    torch.manual_seed(0)
    env_cfg = EnvConfig(name="fast_reach", n_envs=4, episode_len=3, image_size=16)
    envs = [make_env(env_cfg, seed=g) for g in range(groups)]
    spec = envs[0].spec
    policy = build_policy("tiny_vla", PolicySpec(spec.image_shape, spec.proprio_dim, spec.action_dim, 1),
                          {"hidden_dim": 16, "vision_channels": 4, "embed_dim": 4, "n_bins": 5})
    replicas = [copy.deepcopy(policy).requires_grad_(False) for _ in range(2)]
    weights = DoubleBufferedWeights(replicas, [flat_buckets(r) for r in replicas])
    weights.write(0, flat_buckets(copy.deepcopy(policy)))
    requests, replies, sink = LocalChannel(), LocalChannel(), LocalChunks(capacity=16)
    tracer, ledger, stop = Tracer(), Ledger(), threading.Event()
    cfg = SamplingConfig(mode=mode, n_envs=4, group_size=2, episode_len=3, action_chunk=1, has_value=False,
                         chunks_per_update=1, senders=1, max_staleness=1, max_env_failures=2, rank=0,
                         rollout_index=0, rollout_ranks=1, throttle_s=0.01, poll_s=0.01)
    inference = InferenceLane(requests=requests, replies=replies, weights=weights,
                              generator=torch.Generator().manual_seed(1), tracer=tracer, batch_all=True, turns=turns)
    sampling = SamplingLane(envs=envs, prepare=policy.prepare, requests=requests, replies=replies, sink=sink,
                            weights=weights, tracer=tracer, ledger=ledger, cfg=cfg, stop=stop,
                            halt=threading.Event(), turns=turns, serve=inference.serve)
    return sampling, inference, sink, weights, ledger, requests


def test_sampling_and_inference_lanes_step_in_one_thread():
    """A serial driver: the lanes' step() in turn, no threads. Both groups' requests go
    into one forward pass; each finished batch of episodes becomes a chunk stamped with
    the weights version, with GRPO group ids unique across groups and chunks."""
    from swimlane.lanes.admission import Admission

    sampling, inference, sink, weights, ledger, requests = _lanes_on_fast_reach()
    sampling.admission = Admission(0, 1, 1, 1)
    sampling.parked = [0, 1]
    sampling.start_admitted()  # version 0 admits two batches (the learner takes 1 chunk per version)
    assert requests.depth() == 2 and sampling.parked == []
    assert inference.step() and requests.depth() == 0  # one pass answered both groups
    chunks = []
    for _ in range(40):
        inference.step()
        assert sampling.step()
        while (item := sink.get(timeout=0.0)) is not None:
            chunks.append(item)
        if len(chunks) == 2:
            break
    assert len(chunks) == 2 and ledger["chunks_sent"] == 2
    ids = set()
    for batch, meta, _ in chunks:
        assert batch.actions.shape[:2] == (3, 4) and bool((batch.policy_version[batch.valid] == 0).all())
        ids |= set(batch.group_ids.tolist())
    assert ids == {0, 1, 2, 3}  # 2 GRPO groups per env group, 2 env groups
    # Both groups are parked again: version 0 admits no third batch (it would be too stale).
    assert sorted(sampling.parked) == [0, 1] and not sampling.admission.admits(weights.latest_version)


def test_taking_turns_answers_inline_and_holds_one_lock():
    """swimlane.take_turns: the sampling lane answers its own requests in its thread while
    the inference lane's thread idles; simulation holds the rank's lock, so an update
    holding it keeps the simulator waiting; switched off, the inference thread answers
    again and nothing is held."""
    import threading
    import time

    from swimlane.lanes.admission import Admission
    from swimlane.lanes.turns import Turns

    turns = Turns(on=True)
    sampling, inference, sink, weights, ledger, requests = _lanes_on_fast_reach(groups=1, turns=turns)
    answered_in: list[str] = []
    answer = inference._answer

    def spy(*args):
        answered_in.append(threading.current_thread().name)
        return answer(*args)

    inference._answer = spy
    stop = threading.Event()
    thread = threading.Thread(target=inference.run, args=(stop.is_set,), name="inference", daemon=True)
    thread.start()
    try:
        sampling.admission = Admission(0, 1, 1, 1)
        sampling.parked = [0]
        sampling.start_admitted()
        for _ in range(3):  # 3 decisions and the batch ends: one chunk (and the next batch starts)
            assert sampling.step()
        assert sink.get(timeout=0.0) is not None and ledger["chunks_sent"] == 1
        assert answered_in and set(answered_in) == {threading.current_thread().name}  # all inline

        # An update holds the turn: the sampling lane's next step waits for it.
        held = threading.Event()

        def update():
            with turns():
                held.set()
                time.sleep(0.3)

        t = threading.Thread(target=update)
        t.start()
        held.wait()
        t0 = time.perf_counter()
        assert sampling.step()  # answers the request inline, then simulates: after the update
        assert time.perf_counter() - t0 >= 0.25
        t.join()

        turns.set(False)  # back to overlapping: the inference thread answers
        answered_in.clear()
        assert sampling.step() and answered_in and set(answered_in) == {"inference"}
        assert turns() is not turns._lock  # nothing held while off
    finally:
        stop.set()
        turns.set(False)
        thread.join(timeout=5)
    assert not thread.is_alive()


def test_taking_turns_before_the_inference_lane_exists_waits_for_it():
    """The sampling lane may ask for actions before the rank has built its inference lane:
    with turns on it asks again after each wait, rather than wait for a thread that idles."""
    import threading

    from swimlane.lanes.admission import Admission
    from swimlane.lanes.turns import Turns

    sampling, inference, sink, weights, ledger, requests = _lanes_on_fast_reach(groups=1, turns=Turns(on=True))
    built = threading.Event()
    sampling.serve = lambda: built.is_set() and inference.serve()
    threading.Timer(0.2, built.set).start()
    sampling.admission = Admission(0, 1, 1, 1)
    sampling.parked = [0]
    sampling.start_admitted()
    steps = threading.Thread(target=lambda: [sampling.step() for _ in range(3)], daemon=True)
    steps.start()
    steps.join(10)
    alive = steps.is_alive()
    sampling.stop.set()  # (lets a stuck lane end)
    assert not alive and ledger["chunks_sent"] == 1 and built.is_set()


def test_snapshot_slot_hands_over_the_newest_version_and_skips_when_busy():
    import threading

    from swimlane.lanes import SnapshotSlot

    slot, stop, copies = SnapshotSlot(), threading.Event(), []
    assert slot.take(0.0) is None
    assert slot.offer(1, lambda: copies.append(1), wait=False, stop=stop)
    # The reader has not sent version 1 yet: version 2 is skipped, marked pending, not copied.
    assert not slot.offer(2, lambda: copies.append(2), wait=False, stop=stop) and slot.pending
    assert slot.take(0.0) == 1 and not slot.free  # being sent
    assert not slot.offer(3, lambda: copies.append(3), wait=False, stop=stop)
    slot.done()
    assert slot.offer(3, lambda: copies.append(3), wait=False, stop=stop) and not slot.pending
    assert slot.take(0.0) == 3 and copies == [1, 3]
    # A waiting offer gives up when the run stops.
    stop.set()
    assert not slot.offer(4, lambda: copies.append(4), wait=True, stop=stop, poll_s=0.01)
    assert not slot.pending and copies == [1, 3]


def test_the_serial_driver_reports_a_deadlock_and_a_failing_lane():
    import threading

    from swimlane.assembly.driver import LaneError, SerialDriver

    seen = []

    def once():  # does something the first time only
        seen.append(1)
        return len(seen) == 1

    with pytest.raises(RuntimeError, match="serial driver: no lane can go on \\(lanes: a, b\\)"):
        SerialDriver({"a": once, "b": lambda: False}).run(lambda: False, threading.Event())
    assert len(seen) == 2

    def boom():
        raise ValueError("bad chunk")

    with pytest.raises(LaneError, match="lane 'b' failed: ValueError: bad chunk"):
        SerialDriver({"a": lambda: True, "b": boom}).run(lambda: False, threading.Event())
    count = []
    SerialDriver({"a": lambda: count.append(1) or True}).run(lambda: len(count) >= 5, threading.Event())
    assert len(count) == 5


def test_a_local_channel_waits_when_full_and_stops_sending_after_a_stop():
    import threading

    from swimlane.lanes.channels import Chunk, LocalChannel

    ch, stop = LocalChannel(capacity=1, poll_s=0.01), threading.Event()
    assert ch.get(0.0) is None and ch.depth() == 0
    assert ch.put(Chunk("b", {"n": 1}, None), stop) and ch.depth() == 1
    threading.Timer(0.1, stop.set).start()
    assert not ch.put(Chunk("c", {}, None), stop)  # full until the stop: not sent
    assert ch.get(0.0) == ("b", {"n": 1}, None) and ch.get(0.05) is None
    assert not ch.put(Chunk("d", {}, None), stop)  # after a stop nothing more goes in
    unbounded = LocalChannel()
    assert all(unbounded.put(i) for i in range(100)) and unbounded.depth() == 100


def test_only_active_groups_start_batches():
    """swimlane.adaptation.autotune's env_groups knob: a parked group beyond ``active`` is not started."""
    from swimlane.lanes.admission import Admission

    sampling, inference, sink, weights, ledger, requests = _lanes_on_fast_reach(groups=3)
    sampling.admission = Admission(0, 1, 1, 1000)  # admission never holds here
    sampling.active = 1
    sampling.parked = [0, 1, 2]
    sampling.start_admitted()
    assert requests.depth() == 1 and sampling.parked == [1, 2]
    groups = set()
    for _ in range(60):
        inference.step()
        sampling.step()
        while (item := sink.get(timeout=0.0)) is not None:
            groups.add(item.meta["group"])
    assert groups == {0}
    sampling.active = 3
    sampling.start_admitted()
    assert sampling.parked == []


@pytest.mark.alone
def test_inference_waits_for_more_groups_up_to_its_wait():
    """swimlane.adaptation.autotune's inference_wait_ms knob: a forward pass waits (up to wait_s) for
    the other groups' requests and answers them in one pass; without a wait it goes alone,
    and it never waits for groups that do not step."""
    import threading
    import time

    from swimlane.lanes.admission import Admission

    sampling, inference, sink, weights, ledger, requests = _lanes_on_fast_reach(groups=2)
    sampling.admission = Admission(0, 1, 1, 1000)
    inference.groups = 2
    replies = sampling.replies

    def later():
        time.sleep(0.05)
        sampling.start(1)

    def passes():
        return sum(1 for lane, kind, *_ in inference.tracer.spans if lane == "inference" and kind == "infer")

    sampling.start(0)
    inference.wait_s = 0.0
    threading.Thread(target=later).start()
    assert inference.step() and replies.depth() == 1 and passes() == 1  # went alone
    time.sleep(0.1)
    assert inference.step() and replies.depth() == 2 and passes() == 2
    while replies.get(0.0) is not None:
        pass
    sampling.start(0)
    inference.wait_s = 1.0
    t = threading.Thread(target=later)
    t.start()
    t0 = time.perf_counter()
    assert inference.step() and replies.depth() == 2 and passes() == 3  # one pass for both
    assert time.perf_counter() - t0 < 0.9  # it stopped waiting once both groups had asked
    t.join()
    while replies.get(0.0) is not None:
        pass
    inference.groups = lambda: 1  # one group steps now (autotune or a plan parked the other)
    sampling.start(0)
    t0 = time.perf_counter()
    assert inference.step() and replies.depth() == 1 and passes() == 4
    assert time.perf_counter() - t0 < 0.5  # no wait for a group that sends nothing
