"""Tests of the dual-pool memory manager (memory/). CPU tensors exercise the arena logic;
the CUDA-only tests run when a GPU is present and are skipped otherwise."""

import json
import os
import queue
import random
import sys
import threading

import pytest
import torch

from memory import BudgetError  # the package's own error: it imports nothing from dvla
from memory import (
    MIN_BLOCK_BYTES,
    MemoryManager,
    PersistentPool,
    PoolBudgetError,
    PoolStats,
    TransientPool,
    format_bytes,
    parse_budget,
    size_class,
)
from memory import budget as budget_mod

MiB = 1 << 20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# --------------------------------------------------------------------------------------
# Budgets
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        (None, None),
        (0, None),
        ("0", None),
        ("unlimited", None),
        (" Unlimited ", None),
        (1, 1),
        (4096, 4096),
        ("4096", 4096),
        ("512MiB", 512 * MiB),
        ("512 mib", 512 * MiB),
        ("2GB", 2_000_000_000),
        ("1.5GiB", 3 * (1 << 29)),
        ("64KiB", 65536),
    ],
)
def test_parse_budget_forms(spec, expected):
    assert parse_budget(spec, torch.device("cpu")) == expected


def test_parse_budget_fraction_of_cpu_memory(monkeypatch):
    monkeypatch.setattr(budget_mod, "device_total_memory", lambda device: 8 * (1 << 30))
    assert parse_budget(0.25, "cpu") == 2 * (1 << 30)
    assert parse_budget(1.0, "cpu") == 8 * (1 << 30)
    assert parse_budget("50%", "cpu") == 4 * (1 << 30)


def test_cpu_total_memory_is_physical_ram_or_less():
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    total = budget_mod.device_total_memory("cpu")
    assert 0 < total <= physical
    assert parse_budget(0.5, "cpu") == int(0.5 * total)


def test_cgroup_v2_memory_max_is_honoured(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "memory.max").write_text("max\n")
    job = tmp_path / "jobs" / "job1"
    job.mkdir(parents=True)
    (job / "memory.max").write_text(f"{3 * (1 << 30)}\n")
    (tmp_path / "jobs" / "memory.max").write_text(f"{5 * (1 << 30)}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/jobs/job1\n")
    assert budget_mod._cgroup_memory_limit(tmp_path, proc) == 3 * (1 << 30)
    (job / "memory.max").write_text("max\n")  # the parent's limit still applies
    assert budget_mod._cgroup_memory_limit(tmp_path, proc) == 5 * (1 << 30)
    (tmp_path / "jobs" / "memory.max").write_text("max\n")
    assert budget_mod._cgroup_memory_limit(tmp_path, proc) is None


def test_cgroup_v1_memory_limit_is_honoured(tmp_path):
    job = tmp_path / "memory" / "job1"
    job.mkdir(parents=True)
    (job / "memory.limit_in_bytes").write_text(f"{2 * (1 << 30)}\n")
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("5:cpu,cpuacct:/\n4:memory:/job1\n0::/\n")
    assert budget_mod._cgroup_memory_limit(tmp_path, proc) == 2 * (1 << 30)


@pytest.mark.parametrize(
    "spec", [-1, 1.5, -0.5, float("nan"), "lots", "12 parsecs", "1.5", "-3MiB", True, [1], "150%"]
)
def test_parse_budget_rejects_with_field_value_and_forms(spec):
    with pytest.raises(BudgetError) as info:
        parse_budget(spec, "cpu", field="memory.transient_budget")
    msg = str(info.value)
    assert msg.startswith("memory.transient_budget:")
    assert repr(spec) in msg
    assert "'unlimited'" in msg and "'512MiB'" in msg and "(0, 1]" in msg


def test_format_bytes():
    assert format_bytes(12 * MiB) == "12.0 MiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 << 30) == "3.0 GiB"


def test_transient_budget_error_names_pool_request_and_budget():
    pool = TransientPool("cpu", budget_bytes=4 * MiB)
    held = pool.empty((3 * MiB,), torch.uint8)
    with pytest.raises(PoolBudgetError) as info:
        pool.empty((8, 64, 1024), torch.float32)  # 2 MiB
    err = info.value
    assert isinstance(err, MemoryError)
    assert err.pool == "transient" and err.request_bytes == 2 * MiB and err.budget_bytes == 4 * MiB
    msg = str(err)
    assert msg.startswith(
        "transient pool: a request of 2.0 MiB (shape (8, 64, 1024), torch.float32"
    )
    assert "budget of 4.0 MiB" in msg and "reserved 3.0 MiB" in msg and "in use 3.0 MiB" in msg
    pool.release(held)


def test_transient_budget_trims_other_classes_before_failing():
    pool = TransientPool("cpu", budget_bytes=4 * MiB)
    a = pool.empty((3 * MiB,), torch.uint8)
    pool.release(a)  # 3 MiB cached in its class
    b = pool.empty((MiB,), torch.uint8)  # too small to borrow the 3 MiB block: a new 1 MiB one
    assert pool.stats().reserved_bytes == 4 * MiB
    pool.release(b)
    b = pool.empty((2 * MiB,), torch.uint8)  # 1 MiB is too small, 3 MiB within the borrow limit
    assert b.data_ptr() == a.data_ptr()
    pool.release(b)
    pool = TransientPool("cpu", budget_bytes=4 * MiB, borrow_limit=1.0)
    a = pool.empty((3 * MiB,), torch.uint8)
    pool.release(a)  # 3 MiB cached in its class
    b = pool.empty((2 * MiB,), torch.uint8)  # needs a new 2 MiB block: the cached one must go
    s = pool.stats()
    assert s.reserved_bytes == 2 * MiB and s.in_use_bytes == 2 * MiB and s.allocations == 2
    with pytest.raises(PoolBudgetError):
        pool.empty((3 * MiB,), torch.uint8)  # nothing cached is left to drop
    pool.release(b)


def test_persistent_budget_error():
    pool = PersistentPool("cpu", budget_bytes=MiB)
    pool.zeros((512, 256), torch.float32, tag="weights")  # 512 KiB
    with pytest.raises(PoolBudgetError) as info:
        pool.empty((1024, 256), torch.float32, tag="double buffer")
    err = info.value
    assert err.pool == "persistent" and err.request_bytes == MiB and err.budget_bytes == MiB
    msg = str(err)
    assert msg.startswith("persistent pool: a request of 1.0 MiB")
    assert "'double buffer'" in msg and "(1024, 256)" in msg and "torch.float32" in msg
    assert "budget of 1.0 MiB" in msg and "reserved 512.0 KiB" in msg
    assert pool.stats().reserved_bytes == 512 * 1024  # the failed request took nothing


def test_manager_accepts_budget_specs():
    mm = MemoryManager("cpu", persistent_budget="1MiB", transient_budget=None)
    assert mm.persistent.budget_bytes == MiB and mm.transient.budget_bytes is None
    with pytest.raises(BudgetError, match=r"^memory\.transient_budget:"):
        MemoryManager("cpu", transient_budget="huge")


# --------------------------------------------------------------------------------------
# Size classes and reuse
# --------------------------------------------------------------------------------------


def test_size_class_rounding_bound():
    rng = random.Random(0)
    sizes = list(range(1, 5000)) + [rng.randrange(1, 1 << 34) for _ in range(20000)]
    sizes += [(1 << k) + d for k in range(8, 34) for d in (-1, 0, 1)]
    for n in sizes:
        c = size_class(n)
        assert c >= n and c % 64 == 0
        if n > MIN_BLOCK_BYTES:
            assert c < 1.25 * n, (n, c)
        else:
            assert c == MIN_BLOCK_BYTES
    # exactly four classes per power of two
    classes = {size_class(n) for n in range(1025, 2049)}
    assert classes == {1280, 1536, 1792, 2048}


def test_view_shape_dtype_and_alignment():
    pool = TransientPool()
    for dtype in (
        torch.uint8,
        torch.bool,
        torch.float16,
        torch.float32,
        torch.int64,
        torch.complex64,
    ):
        t = pool.empty((5, 7, 3), dtype)
        assert t.shape == (5, 7, 3) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 64 == 0
        t.fill_(1)
        pool.release(t)
    s = pool.empty((), torch.float64)
    assert s.shape == () and s.dtype == torch.float64
    pool.release(s)


def test_released_block_is_reused():
    pool = TransientPool()
    a = pool.empty((100, 100), torch.float32)  # 40000 B -> class 40960
    ptr = a.data_ptr()
    pool.release(a)
    b = pool.empty((10, 1000), torch.float32)  # same class, different shape
    assert b.data_ptr() == ptr
    c = pool.empty((100, 100), torch.float32)  # a has not come back: a new block
    assert c.data_ptr() != ptr
    s = pool.stats()
    assert s.allocations == 2 and s.reuses == 1
    pool.release(c)
    pool.release(b)
    d = pool.empty((100, 100), torch.float32)  # the most recently released block comes first
    assert d.data_ptr() == ptr
    pool.release(d)


def test_borrowing_from_larger_classes_is_bounded():
    pool = TransientPool()
    big = pool.empty((8192,), torch.uint8)
    pool.release(big)
    small = pool.empty((4097,), torch.uint8)  # class 5120: 8192 <= 2 x 5120, borrowed
    assert small.data_ptr() == big.data_ptr()
    s = pool.stats()
    assert s.allocations == 1 and s.reuses == 1 and s.in_use_bytes == 8192
    pool.release(small)
    edge = pool.empty((4096,), torch.uint8)  # class 4096: 8192 == 2 x 4096, still borrowed
    assert edge.data_ptr() == big.data_ptr()
    pool.release(edge)
    too_small = pool.empty((3000,), torch.uint8)  # class 3072: 8192 > 2 x 3072, a new block
    assert too_small.data_ptr() != big.data_ptr()
    assert pool.stats().allocations == 2
    pool.release(too_small)
    strict = TransientPool(borrow_limit=1.0)
    x = strict.empty((8192,), torch.uint8)
    strict.release(x)
    y = strict.empty((4097,), torch.uint8)
    assert y.data_ptr() != x.data_ptr() and strict.stats().allocations == 2
    strict.release(y)
    with pytest.raises(ValueError):
        TransientPool(borrow_limit=0.5)


def test_steady_state_makes_no_new_allocations():
    pool = TransientPool()
    rng = random.Random(1)
    kinds = [
        ((3, 8, 8), torch.uint8),
        ((16,), torch.float32),
        ((), torch.float32),
        ((), torch.bool),
    ]

    def chunk(lease, L):
        for tail, dtype in kinds:
            lease.empty((L, 8) + tail, dtype)

    def one_step(live):
        L = rng.randrange(8, 65)
        with pool.lease() as obs:
            obs.empty((8, 3, 8, 8), torch.uint8)
            lease = pool.lease()
            chunk(lease, L)
        live.append(lease)
        while len(live) > 3:
            live.pop(0).release()

    # Warm-up: at most 4 chunks are alive at once, so 4 of every possible chunk at the same
    # time create at least as many blocks per class as the loop can ever need together.
    with pool.lease() as warm:
        for L in range(8, 65):
            for _ in range(4):
                chunk(warm, L)
    warm_allocations = pool.stats().allocations
    live = []
    for _ in range(500):
        one_step(live)
    while live:
        live.pop().release()
    after = pool.stats()
    assert after.allocations == warm_allocations
    assert after.reuses >= 500 * 5
    assert after.in_use_bytes == 0


def test_zero_size_requests():
    pool = TransientPool()
    t = pool.empty((0, 3), torch.float32)
    assert t.shape == (0, 3) and t.numel() == 0
    assert pool.stats().reserved_bytes == 0
    pool.release(t)
    with pytest.raises(ValueError):
        pool.release(t)
    with pytest.raises(ValueError):
        pool.release(torch.empty(0))


# --------------------------------------------------------------------------------------
# Release rules and leases
# --------------------------------------------------------------------------------------


def test_double_and_foreign_release_raise():
    pool = TransientPool()
    a = pool.empty((64, 64), torch.float32)
    with pytest.raises(ValueError, match="not handed out by this pool"):
        pool.release(torch.empty(64, 64))
    with pytest.raises(ValueError, match="not the tensor empty"):
        pool.release(a.view(-1))  # same memory, different tensor
    with pytest.raises(ValueError):
        pool.release(a[1:])
    pool.release(a)
    with pytest.raises(ValueError, match="already released"):
        pool.release(a)
    b = pool.empty((64, 64), torch.float32)  # reuses a's block
    assert b.data_ptr() == a.data_ptr()
    with pytest.raises(ValueError, match="stale reference"):
        pool.release(a)  # must not free b's block
    assert pool.stats().in_use_bytes == size_class(64 * 64 * 4)
    other = TransientPool()
    with pytest.raises(ValueError):
        other.release(b)
    with pytest.raises(TypeError):
        pool.release("not a tensor")
    pool.release(b)


def test_lease_releases_everything_and_is_idempotent():
    pool = TransientPool()
    lease = pool.lease()
    xs = [lease.empty((n, 32), torch.float32) for n in (1, 10, 100)]
    assert len(lease) == 3 and lease.nbytes == sum(x.numel() * 4 for x in xs)
    assert pool.stats().in_use_bytes > 0
    lease.release()
    s = pool.stats()
    assert s.in_use_bytes == 0 and s.requested_bytes == 0 and s.cached_bytes == s.reserved_bytes
    lease.release()  # no-op
    with pytest.raises(ValueError):
        pool.release(xs[0])  # already given back by the lease
    with pool.lease() as lease2:
        y = lease2.empty((10, 32), torch.float32)
        assert y.data_ptr() == xs[1].data_ptr()
    assert pool.stats().in_use_bytes == 0


def test_lease_releases_on_exception():
    pool = TransientPool()
    with pytest.raises(RuntimeError, match="boom"), pool.lease() as lease:
        lease.empty((1000,), torch.float32)
        raise RuntimeError("boom")
    assert pool.stats().in_use_bytes == 0


def test_stack_and_cat_into_pool_memory():
    pool = TransientPool()
    frames = [torch.randint(0, 255, (3, 8, 8), dtype=torch.uint8) for _ in range(5)]
    with pool.lease() as lease:
        s = pool.stack(frames, dim=1, lease=lease)
        assert torch.equal(s, torch.stack(frames, dim=1))
        c = lease.cat([f[:, :2] for f in frames], dim=-2)
        assert torch.equal(c, torch.cat([f[:, :2] for f in frames], dim=-2))
        m = pool.cat([torch.ones(2, 3), torch.zeros(1, 3, dtype=torch.float64)])
        assert m.dtype == torch.float64 and torch.equal(
            m, torch.tensor([[1.0] * 3] * 2 + [[0.0] * 3]).double()
        )
        assert len(lease) == 2
    assert pool.stats().in_use_bytes == size_class(m.numel() * 8)
    pool.release(m)
    with pytest.raises(ValueError):
        pool.stack([torch.ones(2), torch.ones(3)])
    with pytest.raises(ValueError):
        pool.cat([torch.ones(2, 3), torch.ones(2, 4)], dim=0)
    assert pool.stats().in_use_bytes == 0


def test_activations_is_a_noop_on_cpu():
    pool = TransientPool()
    x = torch.randn(4, 4, requires_grad=True)
    with pool.activations():
        y = (x * 2).sum()
    y.backward()
    assert pool.stats().reserved_bytes == 0


# --------------------------------------------------------------------------------------
# Threads, stats, trim
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("producers, consumers", [(1, 1), (2, 2)])
def test_threads_allocate_and_release_concurrently(producers, consumers):
    # The pipeline case: allocating thread(s) hand tensors over a queue to releasing thread(s).
    pool = TransientPool()
    q: queue.Queue = queue.Queue(maxsize=8)
    n = 3000 // producers
    errors = []

    def producer(seed):
        rng = random.Random(seed)
        try:
            for i in range(n):
                value = seed * n + i  # unique per tensor, exact in float32
                t = pool.empty((rng.randrange(1, 4096),), torch.float32)
                t.fill_(value)
                q.put((value, t))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        q.put(None)

    def consumer():
        try:
            while (item := q.get()) is not None:
                value, t = item
                assert bool((t == value).all()), "a block was handed out twice"
                pool.release(t)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(producers)]
    threads += [threading.Thread(target=consumer) for _ in range(consumers)]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so unguarded updates would race
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors
    s = pool.stats()
    assert s.in_use_bytes == 0 and s.requested_bytes == 0
    assert s.allocations + s.reuses == n * producers
    assert s.reuses > n * producers // 2
    assert s.reserved_bytes == s.cached_bytes == pool.trim()
    assert pool.stats().reserved_bytes == 0


def test_empty_and_release_wait_for_the_pool_lock():
    # Under the GIL the races above are rare; this checks directly that both paths take the
    # pool's lock (needed for consistency across GIL-releasing torch calls and free-threaded
    # Python).
    pool = TransientPool()
    held = pool.empty((1000,), torch.uint8)
    done = []

    def work():
        pool.release(held)
        done.append("release")
        pool.release(pool.empty((10,), torch.uint8))
        done.append("empty")

    worker = threading.Thread(target=work)
    with pool._lock:
        worker.start()
        worker.join(timeout=0.2)
        assert done == []
    worker.join(timeout=10)
    assert done == ["release", "empty"]


def test_stats_and_fragmentation_numbers():
    pool = TransientPool()
    assert pool.stats().fragmentation == 0.0
    a = pool.empty((1100,), torch.uint8)  # class 1280
    b = pool.empty((3000,), torch.uint8)  # class 3072
    s = pool.stats()
    assert (s.reserved_bytes, s.in_use_bytes, s.requested_bytes) == (1280 + 3072, 1280 + 3072, 4100)
    assert s.fragmentation == pytest.approx(1 - 4100 / 4352)
    pool.release(b)
    s = pool.stats()
    assert (s.reserved_bytes, s.in_use_bytes, s.requested_bytes) == (4352, 1280, 1100)
    assert s.cached_bytes == 3072
    assert s.fragmentation == pytest.approx(1 - 1100 / 4352)
    assert s.peak_reserved_bytes == 4352 and s.peak_in_use_bytes == 4352
    m = s.as_metrics()
    assert m["mem/transient/reserved_mb"] == pytest.approx(4352 / MiB)
    assert m["mem/transient/in_use_mb"] == pytest.approx(1280 / MiB)
    assert m["mem/transient/peak_reserved_mb"] == pytest.approx(4352 / MiB)
    assert m["mem/transient/fragmentation"] == pytest.approx(s.fragmentation)
    assert m["mem/transient/allocations"] == 2.0 and m["mem/transient/reuses"] == 0.0
    assert all(isinstance(v, float) for v in m.values())
    pool.release(a)
    assert PoolStats("x", 0, 0, 0, 0, 0, 0, 0, None).fragmentation == 0.0


def test_trim_frees_cached_blocks_only():
    pool = TransientPool()
    keep = pool.empty((5000,), torch.uint8)
    drop = [pool.empty((n,), torch.uint8) for n in (300, 20000, 70000)]
    for t in drop:
        pool.release(t)
    expected = sum(size_class(n) for n in (300, 20000, 70000))
    assert pool.trim() == expected
    s = pool.stats()
    assert s.reserved_bytes == s.in_use_bytes == size_class(5000)
    assert pool.trim() == 0
    again = pool.empty((20000,), torch.uint8)  # its block was trimmed: a new one
    assert pool.stats().allocations == 5
    pool.release(again)
    pool.release(keep)


def test_manager_metrics_and_summary():
    mm = MemoryManager("cpu")
    mm.persistent.zeros((10, 10), torch.float32, tag="w")
    mm.persistent.zeros((10,), torch.float32, tag="w")
    t = mm.transient.empty((10, 10), torch.float32)
    m = mm.metrics()
    assert m["mem/persistent/reserved_mb"] == pytest.approx(440 / MiB)
    assert m["mem/transient/requested_mb"] == pytest.approx(400 / MiB)
    assert "mem/persistent/budget_mb" not in m
    summary = json.loads(json.dumps(mm.summary()))
    assert summary["persistent_tensors"] == {"w": 440}
    assert summary["transient"]["fragmentation"] == pytest.approx(1 - 400 / size_class(400))
    mm.transient.release(t)


# --------------------------------------------------------------------------------------
# Persistent pool: seal and optimizer adoption
# --------------------------------------------------------------------------------------


def test_seal_blocks_later_allocations():
    pool = PersistentPool()
    w = pool.zeros((4, 4), torch.float32, tag="weights")
    assert torch.equal(w, torch.zeros(4, 4))
    assert not pool.sealed
    pool.seal()
    assert pool.sealed
    with pytest.raises(RuntimeError, match=r"persistent pool is sealed: .*'rollout'.*at start-up"):
        pool.empty((4,), torch.float32, tag="rollout")
    with pytest.raises(RuntimeError, match="sealed"):
        pool.zeros((4,), torch.float32)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="sealed"):
        pool.adopt_optimizer(torch.optim.Adam(model.parameters()))
    assert pool.tensors() == {"weights": 64}
    assert pool.stats().allocations == 1


def test_persistent_clone_for_double_buffer():
    pool = PersistentPool()
    src = torch.randn(8, 3, 5, 5).to(memory_format=torch.channels_last)
    copy = pool.clone(src, tag="weights/v1")
    assert torch.equal(copy, src) and copy.stride() == src.stride()
    assert copy.data_ptr() != src.data_ptr()
    assert pool.tensors() == {"weights/v1": src.numel() * 4}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 5),
        torch.nn.Tanh(),
        torch.nn.Linear(5, 2),
    )


def _train(model, opt, steps, data):
    for x, y in data[:steps]:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()


OPTIMIZERS = [
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.01}),
    (torch.optim.Adam, {"foreach": True}),
    (torch.optim.Adam, {"foreach": False, "maximize": True}),
    (torch.optim.AdamW, {}),
    (torch.optim.AdamW, {"amsgrad": True, "foreach": True}),
    (torch.optim.AdamW, {"fused": True}),
]


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_adopt_optimizer_is_bit_identical(cls, kwargs):
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(6, 3, 8, 8, generator=g), torch.randn(6, 2, generator=g)) for _ in "abc"]

    ref_model, model = _model(), _model()
    frozen = model[0].bias
    frozen.requires_grad_(False)
    ref_model[0].bias.requires_grad_(False)
    ref_opt = cls(ref_model.parameters(), lr=1e-2, **kwargs)
    opt = cls(model.parameters(), lr=1e-2, **kwargs)

    pool = PersistentPool()
    pool.adopt_optimizer(opt)
    pool.seal()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(opt.state) == len(trainable) and frozen not in opt.state
    n_bufs = 3 if kwargs.get("amsgrad") else 2
    tags = pool.tensors()
    assert tags["optimizer/exp_avg"] == sum(p.numel() * 4 for p in trainable)
    assert len(tags) == n_bufs + (1 if kwargs.get("capturable") or kwargs.get("fused") else 0)
    pooled = {id(opt.state[p]["exp_avg"]) for p in trainable}

    _train(ref_model, ref_opt, 3, data)
    _train(model, opt, 3, data)  # the sealed pool proves the optimizer allocated no state itself

    for p_ref, p in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p_ref, p)
    for p_ref, p in zip(ref_model.parameters(), model.parameters()):
        s_ref, s = ref_opt.state.get(p_ref, {}), opt.state.get(p, {})
        assert s_ref.keys() == s.keys()
        for key in s_ref:
            assert s_ref[key].dtype == s[key].dtype and s_ref[key].device == s[key].device, key
            assert s_ref[key].stride() == s[key].stride(), key
            assert torch.equal(s_ref[key], s[key]), key
    assert {id(opt.state[p]["exp_avg"]) for p in trainable} == pooled  # still our tensors
    assert ref_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_adopt_optimizer_moves_existing_state_bit_for_bit():
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(6, 3, 8, 8, generator=g), torch.randn(6, 2, generator=g)) for _ in "abc"]
    ref_model, model = _model(), _model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, amsgrad=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    _train(ref_model, ref_opt, 1, data)
    _train(model, opt, 1, data)
    old = [s["exp_avg"] for s in opt.state.values()]  # kept alive: their memory cannot be reused
    pool = PersistentPool()
    pool.adopt_optimizer(opt)
    new = [s["exp_avg"] for s in opt.state.values()]
    assert not {t.data_ptr() for t in old} & {t.data_ptr() for t in new}  # moved into the pool's memory
    assert all(torch.equal(a, b) for a, b in zip(old, new))
    _train(ref_model, ref_opt, 3, data[1:] + data[:1])
    _train(model, opt, 3, data[1:] + data[:1])
    for p_ref, p in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p_ref, p)
        for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert torch.equal(ref_opt.state[p_ref][key], opt.state[p][key])


def test_adopt_optimizer_rejects_other_optimizers_and_budget():
    model = torch.nn.Linear(64, 64)
    with pytest.raises(TypeError, match=r"SGD.*only torch\.optim\.Adam and torch\.optim\.AdamW"):
        PersistentPool().adopt_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    pool = PersistentPool(budget_bytes=16 * 1024)  # Adam state needs 2 x 16.25 KiB
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(PoolBudgetError, match="persistent pool") as info:
        pool.adopt_optimizer(opt)
    assert info.value.request_bytes == 2 * (64 * 64 + 64) * 4
    assert len(opt.state) == 0 and pool.stats().reserved_bytes == 0


# --------------------------------------------------------------------------------------
# CUDA only
# --------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_budget_fraction_uses_device_memory():
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    assert parse_budget(0.5, "cuda") == int(0.5 * total)


@needs_cuda
def test_cuda_pools_use_their_own_mempool_segments():
    mm = MemoryManager("cuda")
    w = mm.persistent.zeros((1024, 1024), torch.float32, tag="weights")
    t = mm.transient.empty((256, 1024), torch.float32)
    assert w.is_cuda and t.is_cuda
    p_seg = mm.persistent.device_segments()
    t_seg = mm.transient.device_segments()
    assert p_seg["segment_bytes"] >= 4 * MiB and p_seg["allocated_bytes"] >= 4 * MiB
    assert t_seg["segment_bytes"] >= MiB
    ptr = t.data_ptr()
    mm.transient.release(t)
    u = mm.transient.empty((1024, 256), torch.float32)
    assert u.data_ptr() == ptr
    mm.transient.release(u)
    assert mm.transient.trim() == size_class(MiB)
    json.dumps(mm.summary())


@needs_cuda
def test_cuda_activations_land_in_transient_segments():
    pool = TransientPool("cuda")
    layer = torch.nn.Linear(1024, 1024).cuda()
    x = torch.randn(512, 1024, device="cuda", requires_grad=True)
    before = (pool.device_segments() or {}).get("segment_bytes", 0)
    with pool.activations():
        y = torch.tanh(layer(x))
    assert pool.device_segments()["segment_bytes"] > before
    y.sum().backward()
    torch.cuda.synchronize()


@needs_cuda
def test_cuda_adopt_optimizer_is_bit_identical():
    torch.manual_seed(0)
    ref = torch.nn.Linear(32, 8).cuda()
    model = torch.nn.Linear(32, 8).cuda()
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, amsgrad=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    pool = PersistentPool("cuda")
    pool.adopt_optimizer(opt)
    for _ in range(3):
        x = torch.randn(16, 32, device="cuda")
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(ref_opt.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"])
    state_bytes = 3 * sum(p.numel() * 4 for p in model.parameters())
    assert pool.device_segments()["allocated_bytes"] >= state_bytes
