"""Checkpoints: atomic writes, corruption detection and fallback, pruning, exact resume."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

import dvla.state.atomic_io as atomic_io
import dvla.state.checkpoint as ckpt
from dvla.state.atomic_io import save_safetensors
from dvla.state.checkpoint import CheckpointError, CheckpointManager
from dvla.state.train_state import load_optimizer_state, optimizer_state, rng_state, set_rng_state


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g),
        "half": torch.randn(5, generator=g).half(),
        "bf16": torch.randn(2, 2, generator=g).bfloat16(),
        "ids": torch.randint(0, 1000, (6,), generator=g),
        "mask": torch.rand(3, generator=g) > 0.5,
        "scalar": torch.tensor(float(seed) + 0.25),
        "view": torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k, t in a.items():
        assert t.dtype == b[k].dtype, k
        assert torch.equal(t, b[k]), k


# -- round trip -----------------------------------------------------------------------------


def test_round_trip_is_bit_exact_and_manifest_complete(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    tensors = sample_tensors()
    path = mgr.save(7, tensors, {"run": "demo", "metrics": {"loss": 0.5}})
    assert path == tmp_path / "ckpt" / "step-00000007"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "tensors.safetensors"]
    assert mgr.list() == [path]

    c = mgr.load(path)
    assert c.path == path and c.step == 7
    assert_same(c.tensors, {k: v.contiguous() for k, v in tensors.items()})

    m = json.loads((path / "manifest.json").read_text())
    assert m == c.manifest == mgr.verify(path)
    assert m["run"] == "demo" and m["metrics"] == {"loss": 0.5}
    assert m["format"] == 1 and m["step"] == 7
    assert datetime.fromisoformat(m["created"]).tzinfo is not None
    data = (path / "tensors.safetensors").read_bytes()
    assert m["files"] == {"tensors.safetensors": {"sha256": hashlib.sha256(data).hexdigest(),
                                                  "bytes": len(data)}}
    latest = mgr.load_latest()
    assert latest.step == 7 and mgr.skipped == []


def test_shared_storage_and_non_json_manifest(tmp_path):
    mgr = CheckpointManager(tmp_path)
    base = torch.arange(6.0)
    path = mgr.save(1, {"a": base, "b": base[2:], "c": base}, {})  # views of one storage
    t = mgr.load(path).tensors
    assert torch.equal(t["a"], base) and torch.equal(t["b"], base[2:])
    with pytest.raises(TypeError):
        mgr.save(2, {"a": base}, {"bad": object()})
    assert mgr.list() == [path]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_empty_or_missing_directory_has_no_latest(tmp_path):
    assert CheckpointManager(tmp_path).load_latest() is None
    assert CheckpointManager(tmp_path / "nope").load_latest() is None
    assert CheckpointManager(tmp_path / "nope").list() == []


# -- atomicity ------------------------------------------------------------------------------


class Crash(RuntimeError):
    pass


def _crash_in_writer(monkeypatch):
    real = atomic_io.save_file  # the checkpoint's tensors go through dvla.state.atomic_io

    def half_then_crash(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        with open(filename, "wb") as f:
            f.write(data[: len(data) // 2])
        raise Crash("power cut while writing tensors")

    monkeypatch.setattr(atomic_io, "save_file", half_then_crash)


def _crash_in_fsync(monkeypatch):
    def boom(fd):
        raise Crash("power cut at fsync")

    monkeypatch.setattr(ckpt.os, "fsync", boom)


def _crash_in_rename(monkeypatch):
    def boom(src, dst):
        raise Crash("power cut at rename")

    monkeypatch.setattr(ckpt.os, "rename", boom)


@pytest.mark.parametrize("crash", [_crash_in_writer, _crash_in_fsync, _crash_in_rename])
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch, crash):
    mgr = CheckpointManager(tmp_path)
    first = mgr.save(1, sample_tensors(1), {"n": 1})
    with monkeypatch.context() as m:
        crash(m)
        with pytest.raises(Crash):
            mgr.save(2, sample_tensors(2), {"n": 2})
    assert mgr.list() == [first]
    assert not (tmp_path / "step-00000002").exists()
    c = CheckpointManager(tmp_path).load_latest()
    assert c.step == 1 and c.manifest["n"] == 1
    assert_same(c.tensors, {k: v.contiguous() for k, v in sample_tensors(1).items()})


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name fds")
def test_save_fsyncs_files_and_dirs_around_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", os.path.basename(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "fsync", fsync)
    monkeypatch.setattr(ckpt.os, "rename", rename)
    CheckpointManager(tmp_path).save(1, sample_tensors(), {})
    names = [(kind, os.path.basename(p)) if kind == "fsync" else (kind, p) for kind, p in events]
    tmp_name = names[2][1]
    assert tmp_name.startswith(".tmp-step-00000001-")
    assert names == [("fsync", "tensors.safetensors"), ("fsync", "manifest.json"), ("fsync", tmp_name),
                     ("rename", "step-00000001"), ("fsync", tmp_path.name)]


def test_leftover_tmp_dir_is_ignored_then_cleaned(tmp_path):
    mgr = CheckpointManager(tmp_path)
    first = mgr.save(1, sample_tensors(1), {})
    # What a process killed mid-save leaves behind: a complete-looking but unpublished dir.
    stale = tmp_path / ".tmp-step-00000002-deadbeef"
    stale.mkdir()
    for f in first.iterdir():
        (stale / f.name).write_bytes(f.read_bytes())
    (tmp_path / ".tmp-step-00000003-cafe").mkdir()
    (tmp_path / ".tmp-step-00000003-cafe" / "tensors.safetensors").write_bytes(b"\0" * 10)

    assert mgr.list() == [first]
    assert mgr.load_latest().step == 1 and mgr.skipped == []
    second = mgr.save(2, sample_tensors(2), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]
    assert mgr.load_latest().path == second


@pytest.mark.parametrize("atomic_swap", [True, False])
def test_same_step_is_replaced(tmp_path, monkeypatch, atomic_swap):
    if not atomic_swap:
        monkeypatch.setattr(ckpt, "exchange_paths", lambda a, b: False)
    mgr = CheckpointManager(tmp_path)
    mgr.save(5, sample_tensors(1), {"v": "old"})
    path = mgr.save(5, sample_tensors(2), {"v": "new"})
    c = mgr.load_latest()
    assert c.path == path and c.manifest["v"] == "new"
    assert_same(c.tensors, {k: v.contiguous() for k, v in sample_tensors(2).items()})
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000005"]


@pytest.mark.parametrize("atomic_swap", [True, False])
def test_crash_while_replacing_same_step_keeps_old(tmp_path, monkeypatch, atomic_swap):
    mgr = CheckpointManager(tmp_path)
    mgr.save(5, sample_tensors(1), {"v": "old"})

    def boom(*args):
        raise Crash("power cut during swap")

    if atomic_swap:
        monkeypatch.setattr(ckpt, "exchange_paths", boom)
    else:
        monkeypatch.setattr(ckpt, "exchange_paths", lambda a, b: False)
        real = os.rename
        monkeypatch.setattr(ckpt.os, "rename",
                            lambda s, d: boom() if ".tmp-step" in str(s) else real(s, d))
    with pytest.raises(Crash):
        mgr.save(5, sample_tensors(2), {"v": "new"})
    monkeypatch.undo()
    c = mgr.load_latest()
    assert c.manifest["v"] == "old"
    assert_same(c.tensors, {k: v.contiguous() for k, v in sample_tensors(1).items()})


def test_save_safetensors_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    save_safetensors({"x": torch.ones(3)}, path, {"version": "1"})
    monkeypatch.setattr(ckpt.os, "replace", lambda s, d: (_ for _ in ()).throw(Crash("cut")))
    with pytest.raises(Crash):
        save_safetensors({"x": torch.zeros(3)}, path, {"version": "2"})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["version"] == "1"
        assert torch.equal(f.get_tensor("x"), torch.ones(3))
    save_safetensors({"x": torch.zeros(3)}, path, {"version": "2"})
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["version"] == "2"


# -- corruption -----------------------------------------------------------------------------


def _flip_byte(path):
    f = path / "tensors.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x01  # inside the tensor data, past the header
    f.write_bytes(bytes(data))


def _truncate(path):
    f = path / "tensors.safetensors"
    f.write_bytes(f.read_bytes()[:-7])


def _drop_manifest(path):
    (path / "manifest.json").unlink()


def _drop_tensors(path):
    (path / "tensors.safetensors").unlink()


def _garbage_manifest(path):
    f = path / "manifest.json"
    f.write_text(f.read_text()[:40])  # a torn write


def _wrong_format(path):
    f = path / "manifest.json"
    m = json.loads(f.read_text())
    m["format"] = 2
    f.write_text(json.dumps(m))


CORRUPTIONS = {
    "flip": (_flip_byte, r"checksum mismatch: expected sha256 [0-9a-f]{64}, actual [0-9a-f]{64}"),
    "truncate": (_truncate, r"truncated: expected \d+ bytes, found \d+"),
    "no-manifest": (_drop_manifest, r"missing manifest\.json"),
    "no-tensors": (_drop_tensors, r"missing tensors\.safetensors"),
    "garbage": (_garbage_manifest, r"manifest\.json is truncated or not valid JSON"),
    "format": (_wrong_format, r"unsupported format version 2"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_is_refused_and_latest_falls_back(tmp_path, caplog, kind):
    damage, reason = CORRUPTIONS[kind]
    mgr = CheckpointManager(tmp_path, keep=5)
    good = mgr.save(1, sample_tensors(1), {})
    bad = mgr.save(2, sample_tensors(2), {})
    damage(bad)

    with pytest.raises(CheckpointError, match=reason) as info:
        mgr.verify(bad)
    assert str(bad) in str(info.value)
    with pytest.raises(CheckpointError, match=reason):
        mgr.load(bad)
    mgr.verify(good)

    with caplog.at_level(logging.ERROR, logger="dvla.state.checkpoint"):
        c = mgr.load_latest()
    assert c.path == good and c.step == 1
    assert len(mgr.skipped) == 1
    path, why = mgr.skipped[0]
    assert path == bad and re.search(reason, why)
    assert any(r.levelno == logging.ERROR and str(bad) in r.getMessage() for r in caplog.records)


def test_all_corrupt_raises_listing_each(tmp_path):
    mgr = CheckpointManager(tmp_path)
    a = mgr.save(1, sample_tensors(1), {})
    b = mgr.save(2, sample_tensors(2), {})
    _flip_byte(a)
    _drop_manifest(b)
    with pytest.raises(CheckpointError) as info:
        mgr.load_latest()
    msg = str(info.value)
    assert str(a) in msg and "checksum mismatch" in msg
    assert str(b) in msg and "missing manifest.json" in msg
    assert [p for p, _ in mgr.skipped] == [b, a]


def test_manifest_step_must_match_directory(tmp_path):
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(3, sample_tensors(), {})
    path.rename(tmp_path / "step-00000004")
    with pytest.raises(CheckpointError, match="manifest step 3 does not match directory name step-00000004"):
        mgr.verify(tmp_path / "step-00000004")


# -- pruning --------------------------------------------------------------------------------


def test_pruning_keeps_newest_valid(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3, 4, 5):
        mgr.save(step, {"x": torch.tensor([step])}, {})
    assert [p.name for p in mgr.list()] == ["step-00000004", "step-00000005"]

    # A corrupt checkpoint does not count towards `keep`, so an older valid one survives.
    _flip_byte(mgr.list()[-1])  # step 5
    mgr._verified.clear()
    mgr.save(6, {"x": torch.tensor([6])}, {})
    assert [p.name for p in mgr.list()] == ["step-00000004", "step-00000006"]


def test_pruning_never_drops_newest_valid_or_newer_corrupt(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=1)
    mgr.save(10, {"x": torch.tensor([10])}, {})
    _flip_byte(mgr.list()[-1])
    mgr._verified.clear()
    mgr.save(5, {"x": torch.tensor([5])}, {})  # older step, the only valid one
    assert [p.name for p in mgr.list()] == ["step-00000005", "step-00000010"]
    assert mgr.load_latest().step == 5
    assert [p.name for p, _ in mgr.skipped] == ["step-00000010"]


# -- optimizer state ------------------------------------------------------------------------


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
}


def train(model, opt, steps, start):
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def assert_optim_equal(a, b):
    for pa, pb in zip((p for g in a.param_groups for p in g["params"]),
                      (p for g in b.param_groups for p in g["params"])):
        sa, sb = a.state[pa], b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _save_training(tmp_path, model, opt):
    otensors, ometa = optimizer_state(opt)
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()} | otensors
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, tensors, {"optim": ometa})
    return mgr


def _restore_training(mgr, model, opt):
    c = mgr.load_latest()
    model.load_state_dict({k[len("model/"):]: v for k, v in c.tensors.items() if k.startswith("model/")})
    load_optimizer_state(opt, {k: v for k, v in c.tensors.items() if k.startswith("optim/")},
                         c.manifest["optim"])


def _reference_run(tmp_path, make_opt):
    """Train 3 steps, checkpoint, train 3 more: the model, its optimizer, the checkpoint
    manager, and a copy of the optimizer state as saved."""
    ref_model = make_model(0)
    ref_opt = make_opt(ref_model.parameters())
    train(ref_model, ref_opt, 3, 0)
    mgr = _save_training(tmp_path, ref_model, ref_opt)
    saved = {k: v.clone() for k, v in optimizer_state(ref_opt)[0].items()}
    train(ref_model, ref_opt, 3, 3)
    return ref_model, ref_opt, mgr, saved


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resume_is_bit_identical(tmp_path, name):
    make_opt = OPTIMIZERS[name]
    ref_model, ref_opt, mgr, _ = _reference_run(tmp_path, make_opt)

    model = make_model(1)  # different init: everything must come from the checkpoint
    opt = make_opt(model.parameters())
    _restore_training(mgr, model, opt)
    assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]
    assert isinstance(opt.param_groups[0]["betas"], tuple)
    train(model, opt, 3, 3)

    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    assert_optim_equal(opt, ref_opt)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_restore_into_preallocated_state_keeps_memory(tmp_path, name):
    make_opt = OPTIMIZERS[name]
    ref_model, ref_opt, mgr, saved = _reference_run(tmp_path, make_opt)

    model = make_model(1)
    opt = make_opt(model.parameters())
    for p in model.parameters():  # what a memory pool does before the first step
        opt.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                            exp_avg_sq=torch.zeros_like(p))
    ptrs = {(i, k): v.data_ptr() for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items()}
    _restore_training(mgr, model, opt)
    after = {(i, k): v.data_ptr() for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items()}
    assert after == ptrs
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, saved[f"optim/{i}/{k}"])
    train(model, opt, 3, 3)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    assert_optim_equal(opt, ref_opt)


def test_hyper_parameters_restored_and_extra_state_dropped():
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, 2, 0)
    opt.param_groups[0]["lr"] = 0.025  # e.g. a scheduler moved it
    tensors, meta = optimizer_state(opt)
    json.dumps(meta)
    assert tensors["optim/0/momentum_buffer"].shape == (8, 6)

    fresh_model = make_model(0)
    fresh = torch.optim.SGD(fresh_model.parameters(), lr=0.1, momentum=0.9)
    stray = next(fresh_model.parameters())
    fresh.state[stray]["junk"] = torch.ones(1)
    load_optimizer_state(fresh, tensors, meta)
    assert fresh.param_groups[0]["lr"] == 0.025
    assert "junk" not in fresh.state[stray]
    assert torch.equal(fresh.state[stray]["momentum_buffer"], tensors["optim/0/momentum_buffer"])


def test_optimizer_shape_and_count_mismatch():
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, 1, 0)
    tensors, meta = optimizer_state(opt)

    other = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    with pytest.raises(CheckpointError, match=r"parameter 0 has shape \(8, 6\) in the checkpoint, \(8, 5\)"):
        load_optimizer_state(torch.optim.Adam(other.parameters()), tensors, meta)
    fewer = nn.Linear(6, 8)
    with pytest.raises(CheckpointError, match="checkpoint has 4 parameters, optimizer has 2"):
        load_optimizer_state(torch.optim.Adam(fewer.parameters()), tensors, meta)


# -- random number generators ---------------------------------------------------------------


def draw(gen):
    return (torch.rand(5), random.random(), random.gauss(0, 1), np.random.rand(3),
            torch.rand(4, generator=gen))


def test_rng_round_trip(tmp_path):
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    gen = torch.Generator().manual_seed(11)
    draw(gen)
    tensors, meta = rng_state({"sampler": gen})
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, tensors, {"rng": meta})  # through disk and json
    reference = draw(gen)

    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    gen2 = torch.Generator().manual_seed(0)
    c = mgr.load_latest()
    set_rng_state(c.tensors, c.manifest["rng"], {"sampler": gen2})
    again = draw(gen2)
    assert torch.equal(again[0], reference[0]) and torch.equal(again[4], reference[4])
    assert again[1] == reference[1] and again[2] == reference[2]
    assert np.array_equal(again[3], reference[3])

    with pytest.raises(CheckpointError, match=r"no state for generator\(s\) \['other'\]"):
        set_rng_state(c.tensors, c.manifest["rng"], {"other": torch.Generator()})


def test_a_generator_saved_on_another_device_is_reseeded_from_its_state(caplog):
    """A CPU run's checkpoint resumed on a GPU (issue #48, 8): the sampling generator's CPU
    state (5056 bytes) cannot go into a CUDA generator (16 bytes, Philox), nor a CUDA one's
    into a CPU generator. The generator restarts from a seed its saved state decides, the same
    on every resume, with a warning. (Here a CUDA generator's state as a checkpoint holds it,
    resumed into a CPU one: the same path.)"""
    philox = torch.tensor([7, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)
    tensors, meta = rng_state({})
    tensors["rng/gen/sample"], meta["generators"]["sample"] = philox, "cuda:0"
    draws = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(len(draws))
        with caplog.at_level("WARNING", logger="dvla.state.checkpoint"):
            set_rng_state(tensors, meta, {"sample": gen})
        draws.append(torch.rand(4, generator=gen))
    assert torch.equal(draws[0], draws[1])
    assert "generator 'sample' was saved on cuda and resumes on cpu" in caplog.text
