"""``dvla sft``: the heads' imitation losses (by hand on tiny cases, and they learn), a policy's
own loss through the hook, the dataset's normalisation stored with the weights and applied at
rollout, the run directory that ``policy.init`` and ``dvla eval`` take, one-line errors, and
the recipe's gain on fast_reach (expert demonstrations -> SFT, short of perfect but far above
the untrained policy -> GRPO from it, significantly above SFT on the same fixed states)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from dvla.app.cli import main as cli
from dvla.config import apply_overrides
from dvla.datasets import Episode
from dvla.datasets.lerobot_format import write_lerobot
from dvla.datasets.record import FastReachExpert, record_batch
from dvla.datasets.stats import dvla_stats
from dvla.distributions import BinnedActionDistribution, GaussianActionDistribution
from dvla.envs import env_spec, make_env
from dvla.evaluation import EvalSetup, evaluate, evaluate_env, load_policy
from dvla.heads.flow import FlowMatchingHead
from dvla.state.init_weights import load_init
from dvla.models.tiny_vla import TinyVLA
from dvla.normalize import Normalizer
from dvla.policy import PolicySpec, build_policy, register_policy
from dvla.config.presets import get_preset
from dvla.app.sft.train import load_frames

FAST = ["run.progress=false", "run.tensorboard=false", "run.torch_threads=1"]


def one_line(text: str) -> str:
    assert "\n" not in text.strip(), text
    return text


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """64 fast_reach expert episodes (the preset's env: privileged proprio, 32 px), ~280 frames."""
    cfg = apply_overrides(get_preset("fast_reach"), ["env.n_envs=32"])
    env = make_env(cfg.env, seed=1)
    expert = FastReachExpert(env)
    episodes = record_batch(env, expert, max_steps=24) + record_batch(env, expert, max_steps=24)
    out = tmp_path_factory.mktemp("demos") / "ds"
    write_lerobot(out, episodes, fps=10, robot_type="fast_reach")
    return out


def sft(tmp: Path, data: Path, *overrides: str) -> Path:
    assert cli(["sft", "--data", str(data), "--out", str(tmp), *FAST, *overrides]) == 0
    return (tmp / "latest").resolve()


def reach_policy(**options):
    spec = PolicySpec.for_env(env_spec(get_preset("fast_reach").env), options.pop("chunk", 1))
    return build_policy("tiny_vla", spec, {"hidden_dim": 32, "vision_channels": 8, "embed_dim": 8, "n_bins": 21,
                                           **options})


# -- the heads' losses ---------------------------------------------------------------------------


def test_gaussian_and_binned_losses_are_the_nll_of_the_valid_steps():
    a = torch.tensor([[[0.5, -1.0], [0.3, 0.3]]])
    valid = torch.tensor([[True, False]])
    g = GaussianActionDistribution(torch.zeros(1, 2, 2), torch.zeros(1, 2, 2))
    loss, stats = g.imitation_loss(a, valid)
    want = 0.5 * (0.25 + 1.0) + math.log(2 * math.pi)  # the first step's two dimensions
    assert loss.item() == pytest.approx(want) and stats["nll"] == pytest.approx(want)
    logits = torch.zeros(1, 2, 2, 3)
    logits[0, 0, 0, 1] = math.log(2)  # bins -1, 0, 1: 0.1 is bin 1 (p = 1/2), 1.0 bin 2 (p = 1/4)
    b = BinnedActionDistribution(logits)
    loss, _ = b.imitation_loss(torch.tensor([[[0.1, 1.0], [0.0, 0.0]]]), valid)
    assert loss.item() == pytest.approx(math.log(2) + math.log(3))
    both, _ = b.imitation_loss(torch.tensor([[[0.1, 1.0], [0.0, 0.0]]]))  # no mask: both steps
    assert both.item() == pytest.approx((math.log(2) + math.log(3) + 2 * math.log(3)) / 2)


def test_the_flow_loss_is_conditional_flow_matching_from_noise_at_0_to_data_at_1():
    cond = torch.tensor([0.5, 2.0])
    head = FlowMatchingHead(lambda x, t, c: c.view(-1, 1, 1) * x + t.view(-1, 1, 1), 2, 3)
    a = torch.randn(2, 2, 3)
    valid = torch.tensor([[True, True], [True, False]])
    loss, stats = head(cond).imitation_loss(a, valid, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    t, x0 = torch.rand(2, generator=g), torch.randn(2, 2, 3, generator=g)
    xt = (1 - t.view(2, 1, 1)) * x0 + t.view(2, 1, 1) * a
    err = (cond.view(2, 1, 1) * xt + t.view(2, 1, 1) - (a - x0)).pow(2).mean(-1)  # (B, K)
    assert loss.item() == pytest.approx(((err[0, 0] + err[0, 1] + err[1, 0]) / 3).item(), rel=1e-5)
    assert stats["flow_mse"] == pytest.approx(loss.item())


def test_the_token_loss_scores_the_demonstrated_actions_bins():
    transformers = pytest.importorskip("transformers")
    from dvla.heads.tokens import TOKENS, TokenActionHead

    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    head = TokenActionHead(vocab_size=48, n_bins=11, action_chunk=2, action_dim=2, hidden_size=32)
    prefix, mask = torch.nn.Parameter(torch.randn(3, 4, 32)), torch.ones(3, 4, dtype=torch.bool)
    a = torch.rand(3, 2, 2) * 2 - 1
    tokens = head.to_tokens(a)
    assert torch.allclose(head.to_actions(tokens), a, atol=0.1 + 1e-6)  # the nearest bin centres
    valid = torch.tensor([[True, True], [True, False], [True, True]])
    loss, _ = head(lm, prefix, mask).imitation_loss(a, valid)
    el = head(lm, prefix, mask).log_prob_elements(a, {TOKENS: tokens}).sum(-1)
    assert loss.item() == pytest.approx(-(el[valid].sum() / 5).item(), rel=1e-5)
    opt = torch.optim.Adam([*lm.parameters(), prefix], lr=3e-3)
    for _ in range(15):
        opt.zero_grad()
        head(lm, prefix, mask).imitation_loss(a, valid)[0].backward()
        opt.step()
    assert head(lm, prefix, mask).imitation_loss(a, valid)[0].item() < 0.5 * loss.item()


@pytest.mark.parametrize("head", ["bins", "gaussian", "flow"])
def test_each_heads_default_loss_learns_a_fixed_batch(data, head):
    """Through ``VLAPolicy.imitation_loss`` on a batch of the dataset."""
    from dvla.datasets import open_dataset

    frames = load_frames(open_dataset(data), 2)
    obs, chunks, valid = frames.batch(np.arange(0, len(frames), 9))
    torch.manual_seed(0)
    policy = reach_policy(head=head, chunk=2)

    def loss() -> float:
        torch.manual_seed(1)  # the flow loss's times and noise
        with torch.no_grad():
            return policy.imitation_loss(obs, chunks, valid)[0].item()

    before = loss()
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    for _ in range(30):
        opt.zero_grad()
        policy.imitation_loss(obs, chunks, valid)[0].backward()
        opt.step()
    assert loss() < (0.85 if head == "flow" else 0.6) * before, (loss(), before)  # (flow: ~0.8, others ~0.3)


@register_policy("sft_own_loss")
class OwnLoss(TinyVLA):
    """A model whose imitation loss is its own: squared error of the mode, logged as ``mse``."""

    calls = 0

    def imitation_loss(self, obs, actions, action_valid=None):
        OwnLoss.calls += 1
        mode = self(self.model_inputs(obs)).dist.mode()
        mse = (mode - self.model_actions(actions, clamp=True)).pow(2).mean()
        return mse, {"mse": float(mse.detach())}


def test_a_policy_overrides_the_hook_and_sft_trains_with_it(data, tmp_path):
    run = sft(tmp_path, data, "policy.name=sft_own_loss", "policy.options.head=gaussian", "run.iterations=6")
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert OwnLoss.calls == 6 and all("mse" in r and "nll" not in r for r in rows)


# -- normalisation -------------------------------------------------------------------------------


def test_normalisation_round_trips_and_is_applied_where_the_policy_meets_the_env():
    rng = np.random.default_rng(0)
    acts = np.stack([rng.uniform(-0.2, 0.6, 500), np.full(500, 0.3)], 1)  # the second never moves
    prop = rng.normal([1.0, -2.0, 0.0, 5.0], [0.1, 2.0, 1.0, 0.5], (500, 4))
    norm = Normalizer.from_stats(dvla_stats(acts, prop))
    a = torch.tensor(acts[:7], dtype=torch.float32)
    assert torch.allclose(norm.unactions(norm.actions(a)), a, atol=1e-6)
    assert norm.actions(a)[:, 1].eq(0.3).all()  # a constant dimension is left as it is
    assert norm.actions(torch.tensor([[-0.2, 0.0], [0.6, 0.0]])).abs().max() <= 1.05  # [q01, q99] -> [-1, 1]
    assert Normalizer.from_json(norm.to_json()).to_json() == norm.to_json()

    policy = reach_policy(head="gaussian").eval()
    seen = []
    forward = policy.forward
    policy.forward = lambda o: (seen.append(o.proprio.clone()), forward(o))[1]
    obs = make_env(get_preset("fast_reach").env, seed=0).reset()
    plain = policy.act(obs, deterministic=True)
    policy.normalizer = norm
    out = policy.act(obs, deterministic=True)
    assert torch.allclose(seen[1], (obs.proprio - norm.proprio_mean) / norm.proprio_std)
    head_mode = forward(policy.model_inputs(obs)).dist.mode()
    assert torch.allclose(out.actions, norm.unactions(head_mode)) and not torch.allclose(out.actions, plain.actions)
    assert torch.allclose(norm.actions(out.actions), head_mode, atol=1e-6)  # a training target's round trip
    # the learner scores the env-space actions the rollout returned as the rollout did
    assert torch.allclose(policy.evaluate(obs, out.actions).log_probs, out.log_probs, atol=1e-4)


# -- the command and its run directory ------------------------------------------------------------


def test_sft_writes_a_run_dir_that_policy_init_and_eval_load(data, tmp_path, capsys):
    run = sft(tmp_path / "sft", data, "run.iterations=20", "policy.action_chunk=2")
    out = capsys.readouterr()
    assert "done: 20 steps" in out.out and f"policy.init={run}" in out.out
    assert {"config.yaml", "metrics.jsonl", "summary.json", "weights.safetensors", "normalization.json"} <= \
        {p.name for p in run.iterdir()}
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert len(rows) == 20 and rows[-1]["version"] == 20 and all(math.isfinite(r["loss"]) for r in rows)
    with safe_open(str(run / "weights.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["policy"] == "tiny_vla" and meta["version"] == "20"
    assert json.loads(meta["normalization"]) == json.loads((run / "normalization.json").read_text())
    # policy.init: weights and normalisation into a freshly built policy
    cfg, evaluated, stored = load_policy(run)  # (dvla eval's loader)
    fresh = build_policy("tiny_vla", PolicySpec.for_env(env_spec(cfg.env), 2), cfg.policy.options)
    assert "version 20" in load_init(fresh, run, "tiny_vla")
    assert fresh.normalizer.to_json() == (run / "normalization.json").read_text()
    obs = make_env(cfg.env, seed=3).reset()
    assert torch.equal(fresh.act(obs, deterministic=True).actions, evaluated.act(obs, deterministic=True).actions)
    fresh.normalizer = None  # (so the comparison above can fail)
    assert not torch.allclose(fresh.act(obs, deterministic=True).actions, evaluated.act(obs, deterministic=True).actions)


def test_mismatched_data_and_several_ranks_are_one_line_errors(data, tmp_path, capsys, monkeypatch):
    ep = Episode(images={"image": np.zeros((3, 32, 32, 3), np.uint8)}, proprio=np.zeros((3, 4), np.float32),
                 actions=np.zeros((3, 3), np.float32), instruction="reach")
    write_lerobot(tmp_path / "three", [ep], fps=10, robot_type="x")
    assert cli(["sft", "--data", str(tmp_path / "three"), "--out", str(tmp_path / "o"), *FAST]) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith("dvla sft: error: ") and "actions have 3 dimensions, the env's have 2" in err
    assert cli(["sft", "--data", str(data), "--out", str(tmp_path / "o"), "env.options.privileged=false", *FAST]) == 2
    assert "proprio" in one_line(capsys.readouterr().err)
    monkeypatch.setenv("RANK", "0")  # (a rank of two under torchrun: stops before joining the group)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli(["sft", "--data", str(data), "--out", str(tmp_path / "o"), "--batch-size", "1", *FAST]) == 2
    assert "--batch-size must be at least the number of ranks (2)" in one_line(capsys.readouterr().err)


RECIPE_EVAL = EvalSetup(episodes=256, n_envs=256, seed=0, steps=12)  # 256 fixed states: the env seeded 0


def sft_then_rl(data: Path, tmp: Path, seed: int = 0, sft_steps: int = 90, rl_updates: int = 8,
                rl_overrides: tuple[str, ...] = ()) -> tuple[dict, dict, dict]:
    """The recipe on fast_reach, each stage scored as ``dvla eval`` scores a run on
    :data:`RECIPE_EVAL`: the untrained policy's, the SFT run's and the RL run's results (each
    with ``episodes`` and ``successes``). SFT: ``sft_steps`` steps on ``data``; RL: GRPO from
    it (``policy.init``) for ``rl_updates`` updates, the preset's 64 envs in groups of 8 on the
    serial sync driver (deterministic), with ``rl_overrides``; both seeded ``seed``."""
    from swimlane import Swimlane

    from dvla.state.checkpoint import weights_digest

    run = sft(tmp / "sft", data, f"run.iterations={sft_steps}", f"run.seed={seed}")
    trained = evaluate(run, RECIPE_EVAL, log=lambda s: None)
    cfg, _, _ = load_policy(run)
    untrained = build_policy(cfg.policy.name, PolicySpec.for_env(env_spec(cfg.env), 1), cfg.policy.options).eval()
    base = evaluate_env(cfg, untrained, RECIPE_EVAL, log=lambda s: None)["tasks"]["fast_reach"]
    # policy.init brings the weights and the normalisation to the learner and the replicas
    lanes = Swimlane(apply_overrides(get_preset("fast_reach"), [
        *FAST, "swimlane.driver=serial", "swimlane.mode=sync", f"run.out_dir={tmp / 'rl'}",
        f"run.iterations={rl_updates}", f"run.seed={seed}", f"policy.init={run}", *rl_overrides]))
    assert lanes.policy.normalizer is not None
    assert weights_digest(lanes.policy) == trained["checkpoint"]["digest"]  # RL starts where SFT ended
    lanes.run()
    rl = evaluate(tmp / "rl", RECIPE_EVAL, log=lambda s: None)  # dvla eval of the RL run
    assert rl["checkpoint_version"] == rl_updates
    _, rl_policy, _ = load_policy(tmp / "rl")  # ... with the SFT run's normalisation
    assert rl_policy.normalizer.to_json() == (run / "normalization.json").read_text()
    return base, trained, rl


@pytest.mark.slow
def test_sft_on_expert_demos_then_rl_from_it_raises_success_significantly(data, tmp_path):
    """The recipe's gain on fast_reach, every stage on the same 256 fixed states: SFT on the
    64 expert episodes, stopped early (90 steps) so that it is far above the untrained policy
    but clearly imperfect, then 8 GRPO updates from it, which must raise success by at least
    0.2, significant by ``dvla eval``'s two-proportion test. Measured (of 256; untrained 29):
    run.seed 0 (this test): SFT 95 -> RL 236 (p 8e-39); seed 1: 87 -> 182 (p 4e-17). With 15
    updates: seed 0 95 -> 244, seeds 1-5: 87 -> 240, 62 -> 136, 137 -> 246, 31 -> 236, 99 -> 245.
    RL that changes nothing (``algo.lr=1e-12``: 95 -> 95) fails it, and so do 2 updates (95 ->
    119: p 0.03, under the margin). About 8-15 s on 2 CPU cores."""
    from dvla.evaluation.stats import compare

    base, trained, rl = sft_then_rl(data, tmp_path)
    n = RECIPE_EVAL.episodes
    numbers = f"untrained {base['successes']}/{n}, SFT {trained['successes']}/{n}, SFT -> RL {rl['successes']}/{n}"
    assert base["successes"] / n <= 0.2 and 0.2 <= trained["success_rate"] <= 0.7, numbers
    assert compare(base, trained)["significant"], numbers
    gain = compare(trained, rl)
    assert gain["difference"] >= 0.2 and gain["significant"], (numbers, gain)


def test_episodes_per_task_trains_on_each_tasks_first_episodes_with_their_statistics(data, tmp_path):
    """``--episodes-per-task N``: each instruction's first N episodes only, normalised with the
    statistics of those (a warm start from few demonstrations out of a larger recording)."""
    from dvla.datasets import open_dataset
    from dvla.datasets.stats import dvla_stats
    from dvla.normalize import Normalizer

    eps = list(open_dataset(data))
    taken, chosen = {}, []
    for ep in eps:
        if taken.get(ep.instruction, 0) < 3:
            taken[ep.instruction] = taken.get(ep.instruction, 0) + 1
            chosen.append(ep)
    assert len(chosen) < len(eps)
    run = sft(tmp_path / "few", data, "run.iterations=2", "--episodes-per-task", "3")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["episodes"] == len(chosen) and summary["frames"] == sum(len(ep) for ep in chosen)
    want = Normalizer.from_stats(dvla_stats(np.concatenate([ep.actions for ep in chosen]).astype(np.float32),
                                            np.concatenate([ep.proprio for ep in chosen]).astype(np.float32)),
                                 "bounds")
    assert (run / "normalization.json").read_text() == want.to_json()
    full = sft(tmp_path / "all", data, "run.iterations=2")
    assert (full / "normalization.json").read_text() != want.to_json()
    assert cli(["sft", "--data", str(data), "--out", str(tmp_path / "o"), "--episodes-per-task", "0", *FAST]) == 2
