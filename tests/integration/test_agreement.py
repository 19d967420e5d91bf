"""Two learner ranks (real gloo group, spawned processes) start from one state, rank 0's:
its initial weights even when the other learner's seed differs, its checkpoint when only
rank 0 can see the checkpoint directory, and a clear error on both when they loaded
different versions. Each learner runs under the recording fake runtime (tests/helpers/fake_runtime.py):
the agreement's broadcasts, like every collective, go through ``Runtime.collective``."""

from __future__ import annotations

import traceback

import pytest
from tests.helpers.ranks import spawn_ranks

from dvla.config import apply_overrides
from dvla.config.presets import debug


def _worker(rank: int, port: int, per_rank: dict[int, list[str]], iterations: int, out) -> None:
    overrides = per_rank[rank]
    import torch.distributed as dist

    from tests.helpers.fake_runtime import installed

    from dvla.state.checkpoint import weights_digest
    from dvla.distributed import shutdown
    from swimlane import Swimlane

    try:
        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
        cfg = apply_overrides(debug(), ["swimlane.learner_ranks=2", "run.torch_threads=1", "run.tensorboard=false", "run.progress=false",
                                        f"run.iterations={iterations}", *overrides])
        with installed() as fake:
            try:
                lanes = Swimlane(cfg, rank=rank, world_size=2)
            except Exception as exc:  # the error each learner reports
                out.put((rank, {"raised": f"{type(exc).__name__}: {exc}", "violations": fake.violations}))
                dist.destroy_process_group()
                return
            start = {"resumed_from": lanes.state.resumed_from, "version": lanes.version,
                     "digest": weights_digest(lanes.policy), "carried": lanes.state.ledger.carried_env_steps}
            summary = lanes.run()
            shutdown()
        out.put((rank, {**start, "final_version": summary["version"], "final_digest": summary["weights_digest"],
                        "violations": fake.violations}))
    except BaseException as exc:
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}))


def run_learners(per_rank: dict[int, list[str]], iterations: int) -> dict[int, dict]:
    got = spawn_ranks(_worker, 2, per_rank, iterations, timeout=180)
    for rank, res in got.items():  # (a worker's own error is in "error")
        assert not res.get("violations"), (rank, sorted(set(res.get("violations"))))
    return got


def _checkpointed_run(path, iterations: int) -> None:
    from swimlane import Swimlane

    Swimlane(apply_overrides(debug(), [f"run.out_dir={path}", f"run.iterations={iterations}",
                                       "run.save_every=2"])).run()


def test_learners_start_from_rank_0s_weights_whatever_their_seed(tmp_path):
    res = run_learners({0: [f"run.out_dir={tmp_path / 'r'}"],
                        1: [f"run.out_dir={tmp_path / 'r'}", "run.seed=7"]}, iterations=2)
    assert res[0]["digest"] == res[1]["digest"]
    assert res[0]["final_digest"] == res[1]["final_digest"] and res[1]["final_version"] == 2


def test_a_learner_that_cannot_see_the_checkpoint_receives_it_from_rank_0(tmp_path):
    _checkpointed_run(tmp_path / "seen", 4)
    res = run_learners({0: [f"run.out_dir={tmp_path / 'seen'}", "run.resume=true"],
                        1: [f"run.out_dir={tmp_path / 'unseen'}", "run.resume=true"]}, iterations=6)
    for r in (0, 1):
        assert res[r]["resumed_from"] == 4 and res[r]["version"] == 4, res
    assert res[0]["digest"] == res[1]["digest"] and res[0]["carried"] == res[1]["carried"] > 0
    assert res[0]["final_version"] == res[1]["final_version"] == 6
    assert res[0]["final_digest"] == res[1]["final_digest"]


def test_learners_that_loaded_different_versions_stop_with_a_clear_error(tmp_path):
    _checkpointed_run(tmp_path / "four", 4)
    _checkpointed_run(tmp_path / "two", 2)
    res = run_learners({0: [f"run.out_dir={tmp_path / 'four'}", "run.resume=true"],
                        1: [f"run.out_dir={tmp_path / 'two'}", "run.resume=true"]}, iterations=6)
    for r in (0, 1):
        assert res[r]["raised"] == ("ConfigError: learners disagree on the checkpoint to resume from: rank 0 has "
                                    "version 4, rank 1 has version 2; give all learners the same run directory "
                                    "(shared storage) or remove the stale checkpoints"), res


def test_rank_0_without_a_checkpoint_stops_every_learner(tmp_path):
    _checkpointed_run(tmp_path / "two", 2)
    res = run_learners({0: [f"run.out_dir={tmp_path / 'none'}", "run.resume=true"],
                        1: [f"run.out_dir={tmp_path / 'two'}", "run.resume=true"]}, iterations=6)
    for r in (0, 1):
        assert res[r]["raised"].startswith("ConfigError: run.resume: no checkpoint in "), res


pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # spawned learners, each a swimlane
