"""Job configuration: nested keyword-only dataclasses with validation.

Every component owns a small ``@dataclass(kw_only=True)`` config. The top-level
:class:`JobConfig` nests them. A config is built from a Python preset
(:mod:`dvla.presets`), optionally merged with a YAML file and command-line
overrides of the form ``env.n_envs=8`` (or ``--env.n_envs=8``).

Errors are raised as :class:`ConfigError` and always name the offending field by
its dotted path, the value that was given and what is allowed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from memory.config import MemoryConfig  # composed into JobConfig (memory owns it)
from planes.config import DataPlaneConfig  # composed into JobConfig (planes owns it)


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


# --------------------------------------------------------------------------------------
# Component configs
# --------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class EnvConfig:
    """Batched environment. ``name`` picks a registered env (see ``dvla.envs.ENV_REGISTRY``)."""

    name: str = "fast_reach"
    """A registered env: ``fast_reach``, ``genesis_reach``, ``genesis_lift``, ``gym``, ``libero``."""
    n_envs: int = 16
    """Parallel environments stepped as one batch (for GRPO: ``n_groups * group_size``)."""
    episode_len: int = 32
    """Policy decisions per episode (each decision executes one action chunk)."""
    image_size: int = 64
    """Square camera resolution in pixels."""
    render: bool = True
    """Produce camera images. When false, images are all zeros (state-only experiments)."""
    reward_shaping: float = 0.0
    """Weight of the dense shaping term (progress towards the goal); 0 gives the sparse reward."""
    success_reward: float = 1.0
    """Reward on the step that reaches the goal."""
    options: dict[str, Any] = field(default_factory=dict)
    """Backend-specific options, validated by the env itself. fast_reach: ``n_targets,
    max_delta, radius, privileged, render_cost_ms, render_wait_ms, wrist_camera, long_tail,
    long_tail_cap, phase_after, phase_after_s, render_cost_ms_after, render_wait_ms_after,
    render_python_ms, render_python_ms_after``;
    genesis: ``max_delta,
    substeps_per_action, dt, privileged, vis_mode, action_mode``; gym: ``gym_id, instruction, image_key,
    make_kwargs``; libero: ``suite, task_ids, wrist_size, init_states, settle_steps, workers``."""
    rank_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Options of single ranks over ``options``, keyed by global rank (``"2": {render_cost_ms:
    12}``): a heterogeneous cluster, or one rank slowed down on purpose (tests, benches)."""

    def for_rank(self, rank: int) -> "EnvConfig":
        """This config as rank ``rank`` builds its envs (its ``rank_options`` applied)."""
        extra = self.rank_options.get(str(rank))
        return dataclasses.replace(self, options={**self.options, **extra}) if extra else self

    def _validate(self) -> list[tuple[str, str]]:
        errs = []
        bad = [k for k, v in self.rank_options.items() if not (k.isdigit() and isinstance(v, dict))]
        if bad:
            errs.append(("rank_options", f"keys are global ranks (\"0\", \"1\", ...) mapping to option dicts; "
                                         f"got {bad}"))
        if self.n_envs < 1:
            errs.append(("n_envs", f"must be >= 1, got {self.n_envs}"))
        if self.episode_len < 1:
            errs.append(("episode_len", f"must be >= 1, got {self.episode_len}"))
        if not 8 <= self.image_size <= 1024:
            errs.append(("image_size", f"must be in [8, 1024], got {self.image_size}"))
        if self.reward_shaping < 0:
            errs.append(("reward_shaping", f"must be >= 0, got {self.reward_shaping}"))
        return errs


@dataclass(kw_only=True)
class PolicyConfig:
    """Policy model. ``name`` picks a registered :class:`dvla.policy.VLAPolicy`;
    ``options`` are checked against that policy's own ``Config`` dataclass."""

    name: str = "tiny_vla"
    """A registered :class:`dvla.policy.VLAPolicy` (see ``POLICY_REGISTRY``)."""
    action_chunk: int = 1
    """Actions predicted per decision (action chunking); the env executes them in order."""
    options: dict[str, Any] = field(default_factory=dict)
    """The policy's own ``Config`` (tiny_vla: ``hidden_dim, vision_channels, embed_dim,
    vocab_size, max_tokens, head (bins|gaussian|flow), n_bins, flow_steps, init_log_std,
    value_head``; token_vla: ``size (tiny|0.5b|7b), vision, lm, n_bins, decoding, tokenizer,
    max_tokens, pretrained_path, lora_rank, lora_alpha, lora_targets, value_head, cameras``)."""

    def _validate(self) -> list[tuple[str, str]]:
        if self.action_chunk < 1:
            return [("action_chunk", f"must be >= 1, got {self.action_chunk}")]
        return []


@dataclass(kw_only=True)
class AlgoConfig:
    """Policy-gradient algorithm and its hyper-parameters."""

    name: Literal["grpo", "ppo"] = "grpo"
    """``grpo`` (group-relative, critic-free) or ``ppo`` (GAE with a value head)."""
    lr: float = 3e-4
    """Adam learning rate."""
    group_size: int = 8
    """GRPO: rollouts per group that start from an identical initial state."""
    update_epochs: int = 2
    """Passes over each batch."""
    minibatches: int = 4
    """Minibatches per pass."""
    clip_eps: float = 0.2
    """Clip range of the PPO surrogate."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    kl_coef: float = 0.0
    """GRPO: weight of the KL penalty to the initial (reference) policy; 0 disables it."""
    value_coef: float = 0.5
    """PPO: weight of the value loss."""
    gamma: float = 0.99
    """PPO: discount."""
    gae_lambda: float = 0.95
    """PPO: GAE lambda."""
    max_grad_norm: float = 1.0
    """Gradient clipping (global norm)."""
    adv_eps: float = 1e-6
    """Added to the standard deviation when advantages are normalised."""
    max_is_weight: float = 2.0
    """Off-policy correction: cap of the importance weight pi_proximal / pi_behaviour
    applied to steps sampled with older weights (decoupled PPO objective)."""
    proximal: Literal["recompute", "loglinear"] = "recompute"
    """Proximal log-probs of stale steps: ``recompute`` them with the learner's weights (one
    forward pass over the stale steps per update), or ``loglinear``: interpolate between the
    behaviour log-prob and the trained policy's, by version lag (AReaL's ``prox_logp_method``,
    A-3PO), which saves that forward pass."""
    ratio: Literal["joint", "step", "dim"] = "joint"
    """Granularity of the importance ratio (and of its clipping and importance weights):
    ``joint`` over the whole action chunk, ``step`` per chunk step, ``dim`` per action
    dimension (a token, for a token head). A joint ratio over many dimensions moves by
    exp(sum of their changes): at 50 x 7 dimensions, 0.01 nat each is e^3.5, and clipping
    stops meaning anything. ``step``/``dim`` need a head with ``log_prob_elements``. Actions
    the env did not apply (the episode ended inside the chunk) count in none of them."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) of every parameter group that does not set its own
    (``VLAPolicy.optim_groups``); 0 uses Adam."""
    train_mode: bool = False
    """Run the policy in train mode (dropout on, batch-norm statistics updated) while it
    learns. False: eval mode, the mode rollouts sample in, so that the importance ratio of
    unchanged weights is exactly 1 (with dropout in train mode it is not: the ratio would
    measure the dropout noise, not the policy's change)."""
    micro_batch: int = 0
    """Samples per forward and backward pass: a minibatch larger than this accumulates the
    gradients of its micro-batches before its one optimizer step (the same update, in less
    activation memory). 0: the whole minibatch in one pass."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16``: the learner's forward passes and losses run under ``torch.autocast`` in
    bfloat16 (sharded: on parameters gathered in bfloat16, gradients reduced in fp32);
    weights and optimizer state stay fp32. Rollouts still sample in fp32, so at unchanged
    weights the importance ratio carries bf16 rounding (not exactly 1)."""
    activation_checkpointing: bool = False
    """Recompute the activations of each block the policy's ``shard_units()`` names during the
    backward pass instead of keeping them from the forward pass: less activation memory for
    one more forward pass of those blocks (``token_vla``: every transformer block)."""
    shard: Literal["auto", "none", "fsdp"] = "auto"
    """``fsdp``: the learner ranks (``swimlane.learner_ranks`` > 1) are FSDP2-sharded: each
    holds 1/N of the weights, gradients and optimizer state, and the weights published to
    the rollouts are gathered one tensor at a time. ``none``: every learner holds the whole
    model and gradients are all-reduced. ``auto``: ``fsdp`` with several learner ranks
    (``none`` with ``swimlane.roles=adaptive``)."""

    def _validate(self) -> list[tuple[str, str]]:
        errs = []
        if self.micro_batch < 0:
            errs.append(("micro_batch", f"must be >= 0 (0: the whole minibatch), got {self.micro_batch}"))
        if self.lr <= 0:
            errs.append(("lr", f"must be > 0, got {self.lr}"))
        if self.group_size < 1:
            errs.append(("group_size", f"must be >= 1, got {self.group_size}"))
        if self.update_epochs < 1:
            errs.append(("update_epochs", f"must be >= 1, got {self.update_epochs}"))
        if self.minibatches < 1:
            errs.append(("minibatches", f"must be >= 1, got {self.minibatches}"))
        if not 0 < self.clip_eps < 1:
            errs.append(("clip_eps", f"must be in (0, 1), got {self.clip_eps}"))
        for name in ("gamma", "gae_lambda"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                errs.append((name, f"must be in [0, 1], got {v}"))
        for name in ("entropy_coef", "kl_coef", "value_coef"):
            if getattr(self, name) < 0:
                errs.append((name, f"must be >= 0, got {getattr(self, name)}"))
        if self.max_grad_norm <= 0:
            errs.append(("max_grad_norm", f"must be > 0, got {self.max_grad_norm}"))
        if self.max_is_weight < 1:
            errs.append(("max_is_weight", f"must be >= 1, got {self.max_is_weight}"))
        return errs


@dataclass(kw_only=True)
class RunConfig:
    """Length of the run, seeding, device and outputs."""

    iterations: int = 50
    """Learner updates (in sync mode: rollout -> learn -> publish cycles)."""
    seed: int = 0
    """Seed of weights, envs and sampling."""
    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``."""
    out_dir: str = "runs/dvla"
    """Base directory of runs. Each ``dvla train`` / ``python -m dvla.launch`` writes to a new
    directory ``out_dir/YYYYmmdd-HHMMSS`` (metrics, config, weights, checkpoints, trace,
    ``summary.json``) and points the symlink ``out_dir/latest`` at it; ``--resume`` continues
    ``latest`` (or ``out_dir`` itself when it is a run directory). ``Swimlane(cfg)`` used from
    Python writes to ``out_dir`` itself."""
    name: str = ""
    """Fixed name of the run directory, ``out_dir/name``, instead of a timestamp (for scripts
    and multi-node jobs that need to know it in advance). A new run refuses a name that
    already holds a run; ``--resume`` continues it."""
    progress: bool = True
    """Show a console progress bar (steps/s, success, weights version, staleness, queue
    depth); false: one line per update."""
    tensorboard: bool = True
    """Also write TensorBoard event files to the run directory's ``tb/`` when the ``tensorboard``
    package is installed (``pip install 'dvla[tb]'``)."""
    save_every: int = 0
    """Write a checkpoint (weights, optimizer state, RNG states, counters) to the run
    directory's ``checkpoints/`` every N learner updates (0: only at the end)."""
    keep_checkpoints: int = 3
    """Newest valid checkpoints kept; older ones are pruned."""
    resume: bool = False
    """Continue from the newest valid checkpoint in the run directory's ``checkpoints/``
    (``--resume``: the run ``out_dir/latest`` points to, or ``out_dir/name``). Ranks
    restarted by ``torchrun --max-restarts`` resume on their own."""
    time_limit_s: float = 0.0
    """Stop after this many seconds of training, as if the last iteration had been
    reached (final checkpoint, summary); 0: no limit."""
    torch_threads: int = 0
    """``torch.set_num_threads`` for this process; 0 keeps PyTorch's default."""

    def _validate(self) -> list[tuple[str, str]]:
        errs = []
        if self.iterations < 1:
            errs.append(("iterations", f"must be >= 1, got {self.iterations}"))
        if self.name and (self.name in (".", "..", "latest") or "/" in self.name or "\\" in self.name
                          or self.name.startswith(".")):
            errs.append(("name", f"must be a plain directory name (no '/', not 'latest' or starting with "
                                 f"'.'), got {self.name!r}"))
        if self.save_every < 0:
            errs.append(("save_every", f"must be >= 0, got {self.save_every}"))
        if self.keep_checkpoints < 1:
            errs.append(("keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}"))
        if self.time_limit_s < 0:
            errs.append(("time_limit_s", f"must be >= 0, got {self.time_limit_s}"))
        if self.torch_threads < 0:
            errs.append(("torch_threads", f"must be >= 0, got {self.torch_threads}"))
        d = self.device
        if not (d in ("auto", "cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit())):
            errs.append(("device", f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {d!r}"))
        return errs


@dataclass(kw_only=True)
class SwimlaneConfig:
    """How the four lanes (sampling, inference, gradient, broadcast) run and overlap."""

    mode: Literal["async", "sync"] = "async"
    """``async``: lanes overlap, rollouts run ahead on slightly stale weights (bounded by
    ``max_staleness``). ``sync``: the same lanes with barriers (sample, then learn, then
    publish, then sample with the new weights), the baseline."""
    env_groups: int = 2
    """Env groups per rollout rank, each a batched env of ``env.n_envs``; in async mode one
    group steps while the others wait for actions."""
    learner_ranks: int = 1
    """Learner ranks (gradients averaged between them): rank 0, then ranks on its host,
    then on as few other hosts as possible (:func:`launch.placement.place`)."""
    colocate: bool = True
    """Learner ranks also run rollout lanes. With false they only learn and publish."""
    driver: Literal["threads", "serial"] = "threads"
    """``threads``: a thread per lane. ``serial`` (sync mode, one process): every lane in
    one thread, round-robin over their non-blocking steps; the deterministic reference."""
    max_staleness: int = 1
    """Drop chunks whose oldest step was chosen by weights more than this many versions
    behind the learner's (0: on-policy only)."""
    independent_envs: bool = False
    """Every env on its own clock: an env starts its next episode as soon as the last one
    ends (a GRPO group once all its episodes have), and a chunk leaves once it holds
    ``env.n_envs`` ended episodes, instead of every env waiting for the slowest episode of
    its batch. A truncated episode bootstraps from the value of its last observation. In
    async mode, admission holds new episodes (not whole groups) while they would reach the
    learner too stale. An episode may start while the chunk before its own still fills, so
    it needs ``max_staleness >= 2``. False: episodes of a batch start together (sync mode's
    bit-exact reference)."""
    segment_len: int = 0
    """PPO with ``independent_envs``: chunks of this many consecutive decisions of every env
    (a column runs across the env's resets and may start or end inside an episode; GAE
    bootstraps at its end and at truncations inside it), instead of one whole episode per
    column. Every env steps all the time (restarts are never held), so no env idles while
    the slowest episode of its chunk finishes, and episodes longer than a chunk are fine.
    0: one episode per column, ``env.episode_len`` decisions per chunk."""
    straggler_factor: float = 2.0
    """A rollout rank whose env steps per second of sampling per env group fall below
    ``1/straggler_factor`` of the median rank's is a straggler: the learners name it in the
    metrics (``stragglers``, ``speed/rank<N>``), the log and the summary
    (:mod:`swimlane.balance`)."""
    balance_window_s: float = 10.0
    """The window over which the learners measure each rollout rank and env group."""
    rebalance: bool = False
    """Async mode, several rollout ranks: rank 0 plans every version, and the plan rides with
    the weights on the control plane. Each rank's share of its learner's chunks follows its
    measured speed (admission no longer holds fast ranks to the pace of the slowest), and a
    straggler hands one env group at a time (at most one per ``balance_window_s``) to the
    fastest rank with a spare one (``spare_groups``): its running batch is sent, then it
    parks, while the spare starts fresh episodes."""
    spare_groups: int = 0
    """With ``rebalance``: env groups each rollout rank builds beyond ``env_groups``, idle
    until a plan hands it one."""
    reissue: bool = False
    """Sync mode, several rollout ranks, threads: a rank that has sent its round's chunks and
    has no new weights yet samples the round's work again (each env group once more, on the
    round's weights), so that the learner's round does not wait for a straggler. The learner
    takes the first chunks of its version from whoever sends them; chunks of an older version
    (a straggler's, or a re-issued batch that finished after the update) are dropped and
    counted (``dropped_stale``), and ``chunks_reissued`` counts the batches sampled again."""
    roles: Literal["fixed", "adaptive"] = "fixed"
    """``adaptive``: ranks move between rollout and learning while the run runs (async
    mode, threads, ``learner_ranks`` >= 2, colocated, unsharded; :mod:`swimlane.roles`).
    Rank 0 always learns; the other learner ranks start sampling. When rank 0's learner
    waits for chunks less than ``role_low`` of its time (learning is the bottleneck), the
    next one stops sampling and joins the learners; above ``role_high`` (the rollouts are),
    the last to join goes back. At most one switch per ``balance_window_s``, at a published
    version (the plan rides with the weights). Every learner rank takes part in every
    update; gradients are averaged over those with samples, so the weights are those of a
    fixed-role run and a switch moves no state. Each learner consumes ``chunks_per_update``
    chunks per version. ``fixed``: roles as placed at the start."""
    role_low: float = 0.1
    """Adaptive roles: below this share of its time waiting for chunks, rank 0's learner
    takes on another learner."""
    role_high: float = 0.5
    """Adaptive roles: above this share of its time waiting for chunks, rank 0's learner
    sends the last learner that joined back to sampling."""
    autotune: bool = False
    """Async mode: a resource manager adjusts the run while it runs, from stage profiles
    measured every ``autotune_window_s`` (env steps/s, idle envs included: the rollout's
    pace; lane busy shares; idle env steps). It moves one knob at a time within bounds,
    keeps a move that raised throughput, reverts one that did not, and stops once no move
    helps, until the throughput shifts.
    Knobs: the env groups that step (1 to ``env_groups``), how long a forward pass waits
    for more groups' requests (0 to 8 ms), ``take_turns``, the gradient lane's niceness (0
    to 15), torch's intra-op threads (1 to the CPUs) and whether the gradient lane and the
    rollout lanes run on separate halves of the CPUs (thread affinity); on a GPU with
    ``cuda_streams``, the inference stream's priority. Simulator threads are not a knob:
    genesis fixes its CPU threads when it starts.
    Its decisions are logged and go into the metrics (``autotune_*``). False: the static
    config."""
    autotune_start_groups: int = 0
    """Autotune: the env groups that step at the start (0: all ``env_groups``). The others
    are built and wait as spares, so that the manager can raise the count as well as lower
    it, up to ``env_groups``."""
    autotune_window_s: float = 2.0
    """Seconds per autotune measuring window, at least: a window also spans at least 4
    chunks sent (a rate over fewer is too noisy to judge a move by), and the first one,
    while the pipeline fills, only starts the clock."""
    take_turns: bool = False
    """Async mode, threads: the lanes take turns instead of overlapping. The sampling lane
    runs the forward passes itself (no hand-off to the inference thread and back each
    step), and on a rank that also learns, simulation and updates hold one lock (it then
    runs like the synchronous loop). For cheap tasks, GIL-holding simulators or too few
    cores, where overlapping threads cost more than they save; a rollout-only rank (the
    learner in a process of its own) keeps the overlap that matters. An autotune knob."""
    chunks_per_update: int = 1
    """Chunks (one env group's batch of episodes each) per learner update; ``sync`` mode
    uses one chunk from every rollout group instead."""
    broadcast_every: int = 1
    """Publish weights after every N learner updates (sync mode needs 1)."""
    cuda_streams: bool = True
    """On CUDA, the inference and gradient lanes each run their device work on a stream of
    their own (inference at a higher priority), so that they overlap on one GPU. False: both
    queue on the default stream. No effect on the CPU."""
    publish_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """The dtype of the published weights: the learner's snapshot, the control plane's
    buckets and the inference replicas (which then sample under bf16 autocast). ``auto``:
    bf16 on CUDA, fp32 on the CPU. A sharded learner gathers each tensor in this dtype."""
    queue_size: int = 4
    """Capacity of the chunk queue between sampling and learning (backpressure beyond)."""
    trace: bool = True
    """Record lane spans to ``trace.json`` in the run directory (``dvla trace`` draws them)."""
    max_env_failures: int = 3
    """A simulator exception in an env group drops that group's batch of episodes and
    resets the group (counted as ``env_errors``); this many failures of one group in a
    row stop the run."""
    max_bad_updates: int = 3
    """An update whose loss or gradient is not finite has its optimizer steps skipped
    (counted as ``updates_non_finite``); this many in a row stop the run with a report."""
    stall_timeout_s: float = 600.0
    """The learner stops the run with a report when no trajectory chunk has arrived for
    this long (a simulator or rollout rank stuck without crashing); 0 disables. Leave
    room for genesis' first kernel compilation (minutes)."""
    topology: str = ""
    """Hosts the ranks run on, for placement. Empty: discovered at start-up (host names
    gathered through the torch.distributed store). Or given, e.g. ``2x4`` (2 hosts x 4
    ranks, numbered host by host as torchrun does); it must cover the world size."""
    hierarchical_broadcast: bool = True
    """Across hosts, send each weights version once to one leader rank per host, which
    fans it out locally. False: one flat broadcast group over all ranks."""
    gradient_nice: int = 0
    """Niceness added to the gradient lane's thread (Linux; elsewhere ignored with a
    warning). Where lanes share too few CPU cores, simulation is the critical path and
    learning has slack: a positive value lets the kernel favour the sampling and inference
    lanes while all three want a core. 0 leaves scheduling alone."""

    def _validate(self) -> list[tuple[str, str]]:
        errs = [(n, f"must be >= 1, got {getattr(self, n)}")
                for n in ("env_groups", "learner_ranks", "chunks_per_update", "broadcast_every", "queue_size",
                          "max_env_failures", "max_bad_updates")
                if getattr(self, n) < 1]
        if self.stall_timeout_s < 0:
            errs.append(("stall_timeout_s", f"must be >= 0, got {self.stall_timeout_s}"))
        if self.autotune and (self.mode != "async" or self.driver != "threads"):
            errs.append(("autotune", "needs swimlane.mode=async and driver=threads (sync rounds take every group)"))
        if self.take_turns and (self.mode != "async" or self.driver != "threads"):
            errs.append(("take_turns", "needs swimlane.mode=async and driver=threads (sync mode and the serial "
                                       "driver take turns already)"))
        if self.autotune_window_s <= 0:
            errs.append(("autotune_window_s", f"must be > 0, got {self.autotune_window_s}"))
        if not 0 <= self.autotune_start_groups <= self.env_groups:
            errs.append(("autotune_start_groups", f"must be in [0, env_groups={self.env_groups}], got "
                                                  f"{self.autotune_start_groups}"))
        elif self.autotune_start_groups and not self.autotune:
            errs.append(("autotune_start_groups", "needs swimlane.autotune=true (spare groups would never step)"))
        if self.straggler_factor <= 1:
            errs.append(("straggler_factor", f"must be > 1, got {self.straggler_factor}"))
        if self.balance_window_s <= 0:
            errs.append(("balance_window_s", f"must be > 0, got {self.balance_window_s}"))
        if self.spare_groups < 0:
            errs.append(("spare_groups", f"must be >= 0, got {self.spare_groups}"))
        elif self.spare_groups and not self.rebalance:
            errs.append(("spare_groups", "only rebalancing starts spare groups: set swimlane.rebalance=true"))
        if self.reissue and (self.mode != "sync" or self.driver != "threads" or self.independent_envs):
            errs.append(("reissue", "needs swimlane.mode=sync, driver=threads and independent_envs=false"))
        if self.rebalance and (self.mode != "async" or self.driver != "threads" or self.autotune):
            errs.append(("rebalance", "needs swimlane.mode=async, driver=threads and autotune=false (autotune "
                                      "moves the env groups that step on its own)"))
        if self.roles == "adaptive" and (self.mode != "async" or self.driver != "threads" or self.autotune
                                         or self.learner_ranks < 2 or not self.colocate):
            errs.append(("roles", "adaptive needs swimlane.mode=async, driver=threads, autotune=false, "
                                  "learner_ranks >= 2 (the candidates) and colocate=true (they sample until they learn)"))
        if not 0 < self.role_low < self.role_high < 1:
            errs.append(("role_low", f"needs 0 < role_low < role_high < 1, got {self.role_low} and {self.role_high}"))
        if self.segment_len < 0:
            errs.append(("segment_len", f"must be >= 0, got {self.segment_len}"))
        elif self.segment_len and not self.independent_envs:
            errs.append(("segment_len", "needs swimlane.independent_envs=true (a column runs across its env's resets)"))
        if self.max_staleness < 0:
            errs.append(("max_staleness", f"must be >= 0, got {self.max_staleness}"))
        elif self.independent_envs and self.max_staleness < 2:
            errs.append(("max_staleness", "must be >= 2 with independent_envs (an episode may start while the "
                                          f"chunk before its own still fills), got {self.max_staleness}"))
        if not 0 <= self.gradient_nice <= 19:
            errs.append(("gradient_nice", f"must be in [0, 19], got {self.gradient_nice}"))
        if self.driver == "serial" and self.mode != "sync":
            errs.append(("driver", "serial needs swimlane.mode=sync (async lanes overlap; one thread cannot)"))
        if self.driver == "serial" and self.env_groups > self.queue_size:
            errs.append(("driver", f"serial needs swimlane.env_groups ({self.env_groups}) <= swimlane.queue_size "
                                   f"({self.queue_size}): a round's chunks must fit before the learner runs"))
        if self.mode == "sync" and self.broadcast_every != 1:
            errs.append(("broadcast_every", f"must be 1 in sync mode, got {self.broadcast_every}"))
        elif self.max_staleness < self.broadcast_every - 1:
            # Between two publishes the learner moves up to broadcast_every - 1 versions
            # past the newest weights any rollout has; with less staleness allowed it would
            # drop everything sampled and wait for data that can never come.
            errs.append(("max_staleness", f"must be >= broadcast_every - 1 = {self.broadcast_every - 1} "
                                          f"(rollouts only see every {self.broadcast_every}th version), "
                                          f"got {self.max_staleness}"))
        return errs


@dataclass(kw_only=True)
class JobConfig:
    """Everything a training job needs."""

    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    run: RunConfig = field(default_factory=RunConfig)
    swimlane: SwimlaneConfig = field(default_factory=SwimlaneConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    data_plane: DataPlaneConfig = field(default_factory=lambda: DataPlaneConfig(send_hwm=1, recv_hwm=1))
    """Few chunks in flight by default: every buffered chunk is one that ages while it waits."""

    def _validate(self) -> list[tuple[str, str]]:
        errs = []
        if self.algo.name == "grpo" and self.env.n_envs % self.algo.group_size != 0:
            errs.append(
                (
                    "env.n_envs",
                    f"GRPO needs n_envs to be a multiple of algo.group_size "
                    f"({self.algo.group_size}), got {self.env.n_envs}",
                )
            )
        if self.swimlane.segment_len and self.algo.name != "ppo":
            errs.append(("swimlane.segment_len", f"segments need algo.name=ppo ({self.algo.name} learns from whole "
                                                 "episodes): set it to 0"))
        if self.algo.shard == "fsdp" and self.swimlane.roles == "adaptive":
            errs.append(("algo.shard", "swimlane.roles=adaptive averages gradients over the learners with samples, "
                                       "which FSDP's reduce-scatter cannot: set algo.shard=none (or auto)"))
        if self.algo.shard == "fsdp" and self.swimlane.learner_ranks < 2:
            errs.append(("algo.shard", "fsdp shards the learners over swimlane.learner_ranks, which is "
                                       f"{self.swimlane.learner_ranks}: set it to 2 or more, or algo.shard=none"))
        dp = self.data_plane
        if dp.curve_authorized_dir and not dp.curve_keys_dir:
            errs.append(("data_plane.curve_authorized_dir", "admits only listed client keys, and rollout ranks "
                                                            "without data_plane.curve_keys_dir make fresh ones: "
                                                            "set curve_keys_dir (dvla keys DIR --ranks N)"))
        return errs

    @property
    def chunk_len(self) -> int:
        """Decisions per chunk: ``swimlane.segment_len``, else ``env.episode_len``."""
        return self.swimlane.segment_len or self.env.episode_len

    @property
    def sharded_learners(self) -> bool:
        """Whether the learners are FSDP2-sharded (``algo.shard``, ``auto`` resolved)."""
        return self.algo.shard == "fsdp" or (self.algo.shard == "auto" and self.swimlane.learner_ranks > 1
                                             and self.swimlane.roles == "fixed")

    # Convenience wrappers -------------------------------------------------------------
    def validate(self) -> "JobConfig":
        validate(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------
# Generic machinery: validation, dict/YAML loading, overrides
# --------------------------------------------------------------------------------------


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is not None:
        tp = origin
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def validate(cfg: Any, path: str = "") -> None:
    """Check types and ranges of a (nested) config dataclass; raise :class:`ConfigError`
    listing every problem with its dotted field path."""
    errors = _collect_errors(cfg, path)
    if errors:
        raise ConfigError("invalid configuration: " + "; ".join(errors))


def _collect_errors(cfg: Any, path: str) -> list[str]:
    errors: list[str] = []
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        fpath = f"{path}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            errors += _collect_errors(value, fpath + ".")
        elif not _type_ok(value, tp):
            errors.append(f"{fpath}: expected {_describe(tp)}, got {value!r}")
    if not errors and hasattr(cfg, "_validate"):
        errors += [f"{path}{name}: {msg}" for name, msg in cfg._validate()]
    return errors


def from_dict(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Build dataclass ``cls`` from a plain dict, rejecting unknown keys by name."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path.rstrip('.') or '<root>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(
                f"{path}{key}: unknown field; allowed: {', '.join(sorted(names))}"
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value, f"{path}{key}.")
        else:
            kwargs[key] = value
    return cls(**kwargs)


def merge(cfg: Any, data: dict[str, Any], path: str = "") -> Any:
    """Return a copy of ``cfg`` with the (possibly partial, nested) ``data`` applied."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path.rstrip('.') or '<root>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(type(cfg))
    names = {f.name for f in dataclasses.fields(cfg)}
    changes = {}
    if "options" in names and data.get("name", getattr(cfg, "name", None)) != getattr(cfg, "name", None):
        # Options belong to the component they were written for: switching the env or
        # policy (``env.name=gym``) starts from none, plus any given with it.
        cfg = dataclasses.replace(cfg, options={})
    for key, value in data.items():
        if key not in names:
            raise ConfigError(
                f"{path}{key}: unknown field; allowed: {', '.join(sorted(names))}"
            )
        if dataclasses.is_dataclass(hints[key]):
            changes[key] = merge(getattr(cfg, key), value, f"{path}{key}.")
        elif isinstance(value, dict) and isinstance(getattr(cfg, key), dict):
            changes[key] = {**getattr(cfg, key), **value}
        else:
            changes[key] = value
    return dataclasses.replace(cfg, **changes)


def load_yaml(cfg: Any, path: str | Path) -> Any:
    """Apply the YAML file at ``path`` on top of ``cfg``. A missing or unreadable file and a
    YAML syntax error are :class:`ConfigError` (the latter naming ``file:line:column``)."""
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"{where}: invalid YAML: {what}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config sections (env:, run:, ...), "
                          f"got {type(data).__name__}")
    try:
        return merge(cfg, data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def parse_override(item: str) -> dict[str, Any]:
    """Turn ``a.b.c=value`` (leading ``--`` allowed) into ``{"a": {"b": {"c": value}}}``.

    The value is parsed as YAML, so ``8`` is an int, ``1e-3`` a float, ``true`` a bool
    and ``[1, 2]`` a list; anything else stays a string.
    """
    text = item[2:] if item.startswith("--") else item
    if "=" not in text:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. env.n_envs=8")
    key, raw = text.split("=", 1)
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: malformed key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):
        # YAML 1.1 reads ``1e-3`` as a string; accept scientific notation for floats.
        try:
            value = float(value)
        except ValueError:
            pass
    out: dict[str, Any] = {}
    node = out
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    for item in overrides:
        cfg = merge(cfg, parse_override(item))
    return cfg


def dump_yaml(cfg: Any, path: str | Path) -> None:
    with open(path, "w") as fh:
        yaml.safe_dump(dataclasses.asdict(cfg), fh, sort_keys=False)
