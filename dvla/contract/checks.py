"""The checks of the policy contract (:mod:`dvla.contract.runner` runs them and reports), in order:
each is a function of the shared context that returns what it measured or raises
:class:`Failed` with what failed (its ``fix`` says what to do); ``needs`` names the checks
whose results it uses (skipped when one did not pass)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from dvla.config import ConfigError, from_dict, validate
from dvla.distributions import ActionDistribution
from dvla.policy import PolicyOutput, PolicySpec, VLAPolicy, build_policy
from dvla.types import Observation

DEFAULT_SPEC = PolicySpec(image_shape=(3, 24, 24), proprio_dim=5, action_dim=3, action_chunk=2)
INSTRUCTIONS = ("pick up the red cube", "reach the blue target", "lift it")  # row 3 repeats row 0's
OTHER_INSTRUCTIONS = ("open the top drawer", "push the green button", "stack the two bowls", "wipe the table")
LOGP_TOLERANCE = 1e-5  # evaluate() of act()'s actions, a state_dict round trip: rtol and atol
BATCH_TOLERANCE = 1e-4  # a row alone vs in a batch: rtol and atol
BF16_TOLERANCE = 0.02  # nats per action dimension between a bf16 replica's and the fp32 learner's log-probs
_MODAL = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)


class Failed(Exception):
    """A check's failure: what failed; ``fix`` overrides the check's own advice."""

    def __init__(self, what: str, fix: str | None = None):
        super().__init__(what)
        self.fix = fix


@dataclass
class Check:
    name: str
    fn: Callable[["Context"], str | tuple[str, dict] | None]
    fix: str
    needs: tuple[str, ...]


CHECKS: list[Check] = []


def _check(name: str, fix: str, needs: tuple[str, ...] = ("act",)):
    def deco(fn):
        CHECKS.append(Check(name, fn, fix, needs))
        return fn
    return deco


def make_obs(spec: PolicySpec, batch: int = 4, seed: int = 1, instructions=None) -> Observation:
    """A batch of random observations of ``spec`` (uint8 cameras, distinct instructions)."""
    g = torch.Generator().manual_seed(seed)
    words = instructions or (INSTRUCTIONS * batch)[:batch]
    return Observation(
        image=torch.randint(0, 256, (batch, *spec.image_shape), dtype=torch.uint8, generator=g),
        proprio=torch.randn(batch, spec.proprio_dim, generator=g), instruction=list(words),
        cameras={n: torch.randint(0, 256, (batch, *s), dtype=torch.uint8, generator=g) for n, s in spec.cameras})


def _row(obs: Observation, i: int) -> Observation:
    return Observation(image=obs.image[i:i + 1], proprio=obs.proprio[i:i + 1], instruction=obs.instruction[i:i + 1],
                       cameras={k: v[i:i + 1] for k, v in obs.cameras.items()})


def _gap(a: Tensor, b: Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max()) if a.numel() else 0.0


class Context:
    def __init__(self, target, spec: PolicySpec, options: dict, batch: int, seed: int, device, entropy_samples: int):
        self.target, self.spec, self.options, self.batch, self.seed = target, spec, options, batch, seed
        self.device, self.entropy_samples = torch.device(device), entropy_samples
        self.obs = make_obs(spec, batch)
        self.policy: VLAPolicy | None = None
        self._fresh: VLAPolicy | None = None

    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def build(self) -> VLAPolicy:
        t = self.target
        if isinstance(t, str):
            return build_policy(t, self.spec, self.options)
        cfg = from_dict(t.Config, dict(self.options), path="policy.options.")
        validate(cfg, path="policy.options.")
        return t(spec=self.spec, config=cfg)

    def fresh(self) -> VLAPolicy:
        """A second build (another seed): other weights, in eval mode."""
        if self._fresh is None:
            torch.manual_seed(self.seed + 1)
            policy = self.policy
            self._fresh = (self.build() if not isinstance(self.target, VLAPolicy)
                           else type(policy)(spec=policy.spec, config=policy.config)).to(self.device).eval()
        return self._fresh

    def score(self, policy: VLAPolicy, obs: Observation | None = None, out=None, ratio="joint") -> Tensor:
        out = self.out if out is None else out
        with torch.no_grad():
            return policy.evaluate(self.obs if obs is None else obs, out.actions, ratio=ratio,
                                   extras=out.extras).log_probs


@_check("builds", "the Config must accept these options, and __init__(spec, config) must build the model "
        "from them and call super().__init__(spec, config)", needs=())
def _builds(c: Context):
    torch.manual_seed(c.seed)
    policy = c.target if isinstance(c.target, VLAPolicy) else c.build()
    c.policy = policy.to(c.device).eval()  # how dvla samples and learns (algo.train_mode=false)
    n = sum(p.numel() for p in policy.parameters())
    t = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    return f"{n:,} parameters ({t:,} trainable), in eval mode, as dvla samples and learns"


@_check("modes", "", needs=("builds",))
def _modes(c: Context):
    modal = sorted({type(m).__name__ for m in c.policy.modules() if isinstance(m, _MODAL) and getattr(m, "p", 1) > 0})
    if not modal:
        return "nothing acts differently in train mode"
    return (f"{', '.join(modal)} differ in train mode; checked in eval mode, as dvla samples and learns: leave "
            "algo.train_mode=false (with it true, the importance ratio of unchanged weights is not 1)")


@_check("forward", "forward(obs) must return PolicyOutput(dist=<an ActionDistribution over (B, K, D)>, "
        "value=None or (B,))", needs=("builds",))
def _forward(c: Context):
    p = c.policy
    with torch.no_grad():
        out = p(p.preprocess(p.prepare(c.obs)))
    if not isinstance(out, PolicyOutput):
        raise Failed(f"forward returned {type(out).__name__}, not PolicyOutput")
    if not isinstance(out.dist, ActionDistribution):
        raise Failed(f"PolicyOutput.dist is {type(out.dist).__name__}, not an ActionDistribution")
    want = (c.batch, c.spec.action_chunk, c.spec.action_dim)
    try:
        c.fwd, c.draw = out, out.dist.draw(False, c.gen(c.seed + 3))
    except Exception as exc:
        raise Failed(f"{type(out.dist).__name__}.draw() raised {type(exc).__name__}: {' '.join(str(exc).split())}; "
                     f"is the distribution over (B, K, D) = {want}?") from exc
    if tuple(c.draw.actions.shape) != want:
        raise Failed(f"the distribution draws actions of shape {tuple(c.draw.actions.shape)}, not (B, K, D) = {want}")
    if out.value is not None and tuple(out.value.shape) != (c.batch,):
        raise Failed(f"PolicyOutput.value has shape {tuple(out.value.shape)}, not (B,) = ({c.batch},)")
    return f"{type(out.dist).__name__} over (B, K, D) = {want}"


@_check("rollout_extras", "rollout_extras() must declare exactly what the head's draw() records beside the actions: "
        "name -> ExtraSpec(shape without the batch, dtype, high for integer ids)", needs=("forward",))
def _extras(c: Context):
    declared, drawn = c.policy.rollout_extras(), c.draw.extras
    if declared.keys() != drawn.keys():
        raise Failed(f"the head draws extras {sorted(drawn)}, rollout_extras() declares {sorted(declared)}")
    for key, want in declared.items():
        got = drawn[key]
        if tuple(got.shape) != (c.batch, *want.shape) or got.dtype != want.dtype:
            raise Failed(f"extra {key!r} drawn as {tuple(got.shape)} {got.dtype}, declared (B, *{want.shape}) "
                         f"{want.dtype}")
        if want.high is not None and got.numel() and not (0 <= int(got.min()) and int(got.max()) < want.high):
            raise Failed(f"extra {key!r} has values in [{int(got.min())}, {int(got.max())}], declared [0, {want.high})")
    return ", ".join(f"{k} {tuple(v.shape)}" for k, v in declared.items()) or "none"


ACT_FIX = ("act() must give actions (B, K, D), finite log-probs (B,) and values (B,): keep the head's "
           "log-probs finite (clamp log-stds, use log_softmax)")


class PolicyError(ConfigError):
    """A policy broke the contract while a job ran it (its first batch of actions, say): a
    user's mistake, one line."""


def act_problem(out: PolicyOutput, batch: int, spec: PolicySpec) -> str | None:
    """What is wrong with ``act()``'s output for ``batch`` observations (None: nothing):
    shapes, and finite values. The swimlane's inference lane checks its first batch with it."""
    k, d = spec.action_chunk, spec.action_dim
    for what, t, want in (("actions", out.actions, (batch, k, d)), ("log_probs", out.log_probs, (batch,)),
                          ("values", out.values, (batch,))):
        if not isinstance(t, Tensor):
            return f"{what} is a {type(t).__name__}, not a tensor"
        if tuple(t.shape) != want:
            return f"{what} has shape {tuple(t.shape)}, not {want}"
        if not torch.isfinite(t).all():
            return f"{what} are not finite: {t.flatten()[:6].tolist()}"
    return None


@_check("act", ACT_FIX, needs=("rollout_extras",))
def _act(c: Context):
    c.out = out = c.policy.act(c.obs, generator=c.gen(c.seed + 3))
    problem = act_problem(out, c.batch, c.spec)
    if problem is not None:
        raise Failed(problem)
    return f"log-probs {[round(float(x), 3) for x in out.log_probs]}"


@_check("seeded", "sample only from the generator draw() is given (torch.randn(..., generator=generator)); nothing "
        "random in forward in eval mode (no F.dropout(training=True), no torch.rand without the generator)")
def _seeded(c: Context):
    again = c.policy.act(c.obs, generator=c.gen(c.seed + 3))
    if not torch.equal(again.actions, c.out.actions):
        raise Failed("two act() calls with generators of the same seed drew different actions")
    if not torch.equal(again.log_probs, c.out.log_probs):
        raise Failed("two act() calls with generators of the same seed gave different log-probs")
    return "the same seed draws the same actions"


@_check("deterministic", "draw(deterministic=True) must return the distribution's mode() and use no randomness",
        needs=("act", "forward"))
def _deterministic(c: Context):
    a = c.policy.act(c.obs, deterministic=True, generator=c.gen(c.seed + 11))
    b = c.policy.act(c.obs, deterministic=True, generator=c.gen(c.seed + 12))
    if not torch.equal(a.actions, b.actions):
        raise Failed("act(deterministic=True) drew different actions under generators of other seeds")
    c.det = a
    try:
        with torch.no_grad():
            mode = c.fwd.dist.mode()
    except NotImplementedError:
        return "the same actions whatever the seed (the distribution has no mode())"
    if not torch.allclose(mode.float(), a.actions.float(), atol=1e-6):
        raise Failed(f"act(deterministic=True) is {_gap(mode, a.actions):.3g} from the distribution's mode()")
    return "the distribution's mode, whatever the seed"


@_check("action_range", "squash the mode into [-1, 1] (tanh on a Gaussian mean; bin centres in [-1, 1]): envs take "
        "actions in [-1, 1]", needs=("deterministic",))
def _range(c: Context):
    top = float(c.det.actions.abs().max())
    if top > 1.0 + 1e-6:
        raise Failed(f"deterministic actions reach {top:.3g} in magnitude")
    return f"deterministic actions within [-{top:.3g}, {top:.3g}]"


@_check("evaluate", "evaluate() must score the recorded actions as draw() did: the same forward pass (nothing that "
        "depends on torch.is_grad_enabled() or on sampling) and log-probs read from the extras draw() recorded")
def _evaluate(c: Context):
    c.ev = ev = c.policy.evaluate(c.obs, c.out.actions, extras=c.out.extras)
    if tuple(ev.log_probs.shape) != (c.batch,):
        raise Failed(f"evaluate() log-probs have shape {tuple(ev.log_probs.shape)}, not ({c.batch},)")
    gap = _gap(ev.log_probs, c.out.log_probs)
    if not torch.allclose(ev.log_probs.detach(), c.out.log_probs, rtol=LOGP_TOLERANCE, atol=LOGP_TOLERANCE):
        raise Failed(f"evaluate() of act()'s actions differs from act()'s log-probs by up to {gap:.3g} "
                     f"(tolerance {LOGP_TOLERANCE:g}): at unchanged weights the importance ratio is not 1")
    if c.out.log_prob_elements is not None:
        dims = c.score(c.policy, ratio="dim")
        if not torch.allclose(dims, c.out.log_prob_elements, rtol=LOGP_TOLERANCE, atol=LOGP_TOLERANCE):
            raise Failed(f"per-dimension log-probs (algo.ratio=dim) differ from act()'s log_prob_elements by up to "
                         f"{_gap(dims, c.out.log_prob_elements):.3g}")
    return f"act()'s log-probs, within {gap:.2g} (joint{', per dimension' if c.out.log_prob_elements is not None else ''})"


@_check("entropy", "entropy(extras) must be the entropy of the distribution draw() samples from, per decision "
        "(summed over the chunk), finite", needs=("evaluate",))
def _entropy(c: Context):
    ent = c.ev.entropy
    if tuple(ent.shape) != (c.batch,) or not torch.isfinite(ent).all():
        raise Failed(f"entropy is {tuple(ent.shape)} {ent.detach().flatten()[:4].tolist()}, not finite ({c.batch},)")
    n, b = c.entropy_samples, c.batch
    if n < 2:
        return "finite (B,)"
    many = Observation(image=c.obs.image.repeat(n, 1, 1, 1), proprio=c.obs.proprio.repeat(n, 1),
                       instruction=list(c.obs.instruction) * n,
                       cameras={k: v.repeat(n, 1, 1, 1) for k, v in c.obs.cameras.items()})
    with torch.no_grad():
        drawn = c.policy.act(many, generator=c.gen(c.seed + 5))
        lp = drawn.log_probs.float().view(n, b)
        ent = c.policy.evaluate(many, drawn.actions, extras=drawn.extras).entropy.float().view(n, b).mean(0)
    estimate, se = -lp.mean(0), lp.std(0) / n**0.5
    if not ((estimate - ent).abs() <= 5 * se + 1e-3).all():
        raise Failed(f"entropy() {[round(float(x), 3) for x in ent]} but minus the mean log-prob of {n} samples is "
                     f"{[round(float(x), 3) for x in estimate]} (+- {float(se.max()):.3f})")
    return f"finite, and within 5 standard errors of minus the mean log-prob of {n} samples"


@_check("temperature", "tempered(t) of the head's distribution must keep its mode and sample from, and score "
        "under, the distribution at temperature t (policy.temperature): spread times t, logits divided by t",
        needs=("evaluate", "deterministic"))
def _temperature(c: Context):
    before = c.policy.temperature
    c.policy.temperature = 0.5
    try:
        try:
            det = c.policy.act(c.obs, deterministic=True)
        except NotImplementedError:
            return "the head has no tempered(): policy.temperature must stay 1"
        if not torch.allclose(det.actions.float(), c.det.actions.float(), atol=1e-6):
            raise Failed(f"at temperature 0.5 the most likely actions move by {_gap(det.actions, c.det.actions):.3g}")
        drawn = c.policy.act(c.obs, generator=c.gen(c.seed + 13))
        ev = c.policy.evaluate(c.obs, drawn.actions, extras=drawn.extras)
        if not torch.allclose(ev.log_probs.detach(), drawn.log_probs, rtol=LOGP_TOLERANCE, atol=LOGP_TOLERANCE):
            raise Failed(f"at temperature 0.5, evaluate() differs from act()'s log-probs by up to "
                         f"{_gap(ev.log_probs, drawn.log_probs):.3g}")
        if not bool((ev.entropy.detach() < c.ev.entropy.detach() + 1e-6).all()):
            raise Failed("the entropy at temperature 0.5 is not below the entropy at 1")
    finally:
        c.policy.temperature = before
    return "the same mode at 0.5; act() and evaluate() agree there, with less entropy"


@_check("gradients", "the log-probs (and values) must reach the trainable parameters: no .detach() or "
        "torch.no_grad() in forward; trainable parameters (requires_grad) the loss does not use can be frozen",
        needs=("evaluate",))
def _gradients(c: Context):
    p, ev = c.policy, c.ev
    loss = -ev.log_probs.mean() - ev.entropy.mean()
    if ev.values is not None:
        loss = loss + ev.values.float().pow(2).mean()
    if not loss.requires_grad:
        raise Failed("the loss (-log-probs - entropy) has no gradient at all")
    loss.backward()
    named = [(n, q) for n, q in p.named_parameters() if q.requires_grad]
    bad = [n for n, q in named if q.grad is not None and not torch.isfinite(q.grad).all()]
    reached = [n for n, q in named if q.grad is not None and q.grad.abs().sum() > 0]
    none = [n for n, q in named if q.grad is None]
    for _, q in named:
        q.grad = None
    if bad:
        raise Failed(f"non-finite gradients in {', '.join(bad[:3])}")
    if not reached:
        raise Failed(f"none of the {len(named)} trainable parameter tensors gets a gradient")
    unused = f" (none reaches {', '.join(none[:3])}{' ...' if len(none) > 3 else ''})" if none else ""
    return f"{len(reached)} of {len(named)} trainable parameter tensors get a gradient{unused}"


@_check("value_head", "set has_value_head = True only where forward returns PolicyOutput(value=(B,)) or "
        "estimate_value(obs) returns (B,)", needs=("evaluate",))
def _value_head(c: Context):
    if not c.policy.has_value_head:
        return "no value head (GRPO; PPO needs one)"
    values = c.ev.values
    if values is None or tuple(values.shape) != (c.batch,):
        raise Failed(f"has_value_head is True but evaluate() values are {None if values is None else tuple(values.shape)}"
                     f", not ({c.batch},)")
    boot = c.policy.value(c.obs)
    if not torch.allclose(boot.float(), c.out.values.float(), rtol=LOGP_TOLERANCE, atol=LOGP_TOLERANCE):
        raise Failed(f"value() (the bootstrap) differs from act()'s values by {_gap(boot, c.out.values):.3g}")
    return "values (B,) from evaluate(), act() and value() agree"


@_check("language", "forward must read obs.instruction_ids and obs.instruction_mask (the tokenised instructions)")
def _language(c: Context):
    other = dataclasses.replace(c.obs, instruction=list((OTHER_INSTRUCTIONS * c.batch)[:c.batch]))
    if not torch.equal(c.score(c.policy), c.score(c.policy, other)):
        return "other instructions change the log-probs of the same actions"
    perturbed = copy.deepcopy(c.policy)  # a zero-initialised path (FiLM, LoRA B) hides the language at first
    with torch.no_grad():
        for q in perturbed.parameters():
            if q.is_floating_point():
                q.add_(torch.randn_like(q) * 0.05)
    if torch.equal(c.score(perturbed), c.score(perturbed, other)):
        raise Failed("other instructions leave the log-probs of the same actions unchanged, even with perturbed weights")
    return "other instructions change the log-probs (once the weights move: a path is zero-initialised)"


@_check("batch_rows", "each row's output must depend on its own observation only: no statistics over the batch "
        "(normalising by its mean, batch norm in train mode), padding masked (instruction_mask)")
def _batch_rows(c: Context):
    whole = c.score(c.policy)
    rows = torch.cat([c.score(c.policy, _row(c.obs, i), c.out.rows(i, i + 1)) for i in range(c.batch)])
    gap = _gap(whole, rows)
    if not torch.allclose(whole, rows, rtol=BATCH_TOLERANCE, atol=BATCH_TOLERANCE):
        raise Failed(f"a row scored alone differs from the same row in a batch of {c.batch} by {gap:.3g} "
                     f"(tolerance {BATCH_TOLERANCE:g})")
    return f"a row alone scores as in the batch (within {gap:.2g})"


@_check("bf16", "keep the head's numerics in fp32 (.float() the logits or means before log_softmax and the "
        "log-prob) and avoid bf16-fragile ops (large offsets, long sums); or publish fp32 replicas "
        "(swimlane.publish_dtype=fp32)")
def _bf16(c: Context):
    replica = copy.deepcopy(c.policy).requires_grad_(False).to(torch.bfloat16)  # as swimlane publishes one
    drawn = replica.act(c.obs, generator=c.gen(c.seed + 3))
    del replica
    declared = c.policy.rollout_extras()  # the data plane carries the extras in their declared dtypes
    extras = {k: v.to(declared[k].dtype) if k in declared else v for k, v in drawn.extras.items()}
    fp32 = c.score(c.policy, out=dataclasses.replace(drawn, actions=drawn.actions.float(), extras=extras))
    dims = c.spec.action_chunk * c.spec.action_dim
    gap = (fp32 - drawn.log_probs.float()).abs()
    joint, per_dim = float(gap.max()), float(gap.max()) / dims
    measured = {"joint": joint, "per_dim": per_dim}
    if not torch.isfinite(gap).all() or per_dim > BF16_TOLERANCE:
        raise Failed(f"a bf16 replica's log-probs and the fp32 learner's of the same actions differ by up to {joint:.3g} "
                     f"nats per decision, {per_dim:.3g} per action dimension (tolerance {BF16_TOLERANCE:g})")
    return (f"bf16 replica vs fp32 learner, same actions: up to {joint:.2g} nats per decision, {per_dim:.2g} per "
            f"action dimension (tolerance {BF16_TOLERANCE:g})", measured)


@_check("replica", "a replica is copy.deepcopy(policy): keep no references to the original (closures over self, "
        "hooks on it), so that a copy given other weights computes with them")
def _replica(c: Context):
    replica = copy.deepcopy(c.policy)
    same = replica.act(c.obs, generator=c.gen(c.seed + 3))
    if not (torch.equal(same.actions, c.out.actions) and torch.allclose(same.log_probs, c.out.log_probs)):
        raise Failed("a deep copy acts differently from the policy it was copied from")
    fresh = c.fresh()
    replica.load_state_dict(fresh.state_dict())
    gap = _gap(c.score(replica), c.score(fresh))
    if gap > LOGP_TOLERANCE:
        raise Failed(f"a deep copy given another build's weights scores {gap:.3g} away from that build")
    return "a deep copy acts like the original, and like other weights once given them"


@_check("state_dict", "register every tensor the model computes with as a parameter or a (persistent) buffer, and "
        "create none lazily in forward: checkpoints and weight broadcasts carry the state_dict only")
def _state_dict(c: Context):
    fresh = c.fresh()
    fresh.load_state_dict(c.policy.state_dict(), strict=True)
    gap = _gap(c.score(fresh), c.score(c.policy))
    if gap > LOGP_TOLERANCE:
        raise Failed(f"another build loaded with this policy's state_dict scores the same actions {gap:.3g} away")
    return "another build given this state_dict scores the same"


