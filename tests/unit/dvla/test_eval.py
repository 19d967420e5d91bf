"""``dvla eval`` on an env without tasks (fast_reach): per task successes/episodes with a 95%
Wilson interval, the same numbers from a second evaluation, several runs side by side on the
same seeded states with the difference and a pooled two-proportion z-test, and an eval.json
that says what was evaluated. One short trained run is shared by the module; a second run is
that run with other weights."""

import json
import shutil

import pytest
import torch

from dvla.state.checkpoint import save_weights
from dvla.app.cli import main as cli
from dvla.config import apply_overrides
from dvla.evaluation.stats import two_proportion_test, wilson
from dvla.config.presets import debug

pytestmark = pytest.mark.xdist_group("eval")

EPISODES = ["--episodes", "16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run A: one update of the debug preset; run B: A with an action head that always picks
    the middle bin (action 0: it stays put, and succeeds only where it starts at the goal)."""
    from safetensors.torch import load_file

    from swimlane import Swimlane

    base = tmp_path_factory.mktemp("eval")
    a, b = base / "a", base / "b"
    cfg = apply_overrides(debug(), ["swimlane.driver=serial", "swimlane.mode=sync", "run.tensorboard=false",
                                    "run.torch_threads=1", "run.iterations=1", f"run.out_dir={a}"])
    lanes = Swimlane(cfg)
    lanes.run()
    shutil.copytree(a, b)
    lanes.policy.load_state_dict(load_file(str(a / "weights.safetensors")))
    with torch.no_grad():
        lanes.policy.action_head.weight.zero_()
        lanes.policy.action_head.bias.copy_(torch.tensor([0.0] * 10 + [10.0] + [0.0] * 10).repeat(2))
    save_weights(lanes.policy, b / "weights.safetensors", 1)
    return a, b


def test_the_wilson_interval_and_the_pooled_z_test_give_known_values():
    lo, hi = wilson(50, 100)  # (scipy.stats.binomtest(50, 100).proportion_ci(method="wilson"))
    assert lo == pytest.approx(0.403832, abs=1e-6) and hi == pytest.approx(0.596168, abs=1e-6)
    assert wilson(0, 10) == (0.0, pytest.approx(0.277533, abs=1e-6)) and wilson(10, 10)[1] == 1.0
    diff, z, p = two_proportion_test(50, 100, 65, 100)  # pooled rate 0.575; 2 * scipy.stats.norm.sf(z)
    assert diff == pytest.approx(0.15) and z == pytest.approx(2.145596, abs=1e-6) and p == pytest.approx(0.031905, abs=1e-6)
    assert two_proportion_test(10, 10, 10, 10) == (0.0, 0.0, 1.0)


def test_one_run_per_task_interval_and_a_second_evaluation_gives_the_same_numbers(runs, capsys):
    a, _ = runs
    assert cli(["eval", str(a), *EPISODES, "--seed", "3"]) == 0
    out = capsys.readouterr().out
    first = json.loads((a / "eval.json").read_text())
    task = first["tasks"]["fast_reach"]
    lo, hi = wilson(task["successes"], 16)
    assert f"task fast_reach: {task['successes']}/16 = {task['successes'] / 16:.2f}  95% CI [{lo:.2f}, {hi:.2f}]" in out
    assert task["episodes"] == 16 and task["ci95"] == [lo, hi] and task["env_seed"] == 3 and task["n_envs"] == 8
    ck = first["checkpoint"]
    assert ck["path"] == str(a / "weights.safetensors") and ck["version"] == 1 and ck["policy"] == "tiny_vla"
    assert len(ck["digest"]) == 16 and first["seed"] == 3 and first["deterministic"] is True
    assert first["command"] == f"dvla eval {a} --episodes 16 --seed 3" and first["commit"]
    assert "episode i: env i % 8 after reset i // 8 of the env seeded 3" == first["states"]
    assert cli(["eval", str(a), *EPISODES, "--seed", "3"]) == 0
    second = json.loads((a / "eval.json").read_text())
    assert second["tasks"] == first["tasks"] and second["checkpoint"] == first["checkpoint"]


def test_runs_side_by_side_on_the_same_states_with_difference_and_p_value(runs, tmp_path, capsys):
    a, b = runs
    out_file = tmp_path / "ab.json"
    assert cli(["eval", str(a), str(b), str(a), *EPISODES, "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    got = json.loads(out_file.read_text())
    ra, rb, ra2 = got["runs"]
    assert ra["tasks"] == ra2["tasks"]  # the same states for every run: A again scores exactly A
    assert ra["checkpoint"]["digest"] != rb["checkpoint"]["digest"]
    vs_b, vs_a = got["comparisons"]
    diff, _, p = two_proportion_test(ra["successes"], 16, rb["successes"], 16)
    assert vs_b["run"] == str(b) and vs_b["overall"]["difference"] == diff and vs_b["overall"]["p_value"] == p
    assert vs_b["tasks"]["fast_reach"]["p_value"] == p and vs_b["overall"]["significant"] == (p < 0.05)
    assert vs_a["overall"] == {"difference": 0.0, "z": 0.0, "p_value": 1.0, "significant": False}
    table = out[out.index("task  "):]
    assert "A: a" in table and "B: b" in table and f"{diff:+.2f}  {p:.3f}" in table and "+0.00  1.000" in table
    assert "pooled two-proportion z-test" in table and not (b / "eval.json").exists()


def test_sampled_actions_at_the_runs_temperature_or_another(runs, tmp_path):
    """``--sample`` records the run's temperature (1); at a temperature near 0 the sampled
    actions are the most likely ones, so the same episodes succeed."""
    a, _ = runs
    got = {}
    for name, extra in (("mode", []), ("run", ["--sample"]), ("cold", ["--sample", "--temperature", "1e-4"])):
        assert cli(["eval", str(a), *EPISODES, "--seed", "5", *extra, "--out", str(tmp_path / name)]) == 0
        got[name] = json.loads((tmp_path / name).read_text())["runs"][0]
    assert got["mode"]["temperature"] is None and got["run"]["temperature"] == 1.0
    assert got["cold"]["temperature"] == 1e-4 and got["cold"]["deterministic"] is False
    assert got["cold"]["tasks"] == got["mode"]["tasks"]


def test_runs_of_other_envs_and_libero_options_are_one_line_errors(runs, tmp_path, capsys):
    a, _ = runs
    c = tmp_path / "c"
    shutil.copytree(a, c)
    (c / "config.yaml").write_text((c / "config.yaml").read_text().replace("name: fast_reach", "name: gym"))
    for args, words in (([str(a), str(c)], "runs are compared on the same env's states"),
                        ([str(a), "--suite", "libero_10"], "trained on env 'fast_reach', not libero"),
                        ([str(tmp_path / "nope")], "not a run directory"),
                        ([str(a), "--temperature", "0.5"], "with --sample"),
                        ([str(a), "--sample", "--temperature", "-1"], "a temperature >= 0"),
                        # (0 is a flow chain's: noise at its start only; the bins of this run have none)
                        ([str(a), "--sample", "--temperature", "0"], "temperature of bins must be > 0")):
        assert cli(["eval", *args, *EPISODES]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("dvla eval: error: ") and words in err, err
