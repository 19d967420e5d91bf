"""The swimlane's section of the job configuration (``swimlane.*``): how the lanes run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dvla.config.rules import bounded


@dataclass(kw_only=True)
class SwimlaneConfig:
    """How the four lanes (sampling, inference, gradient, broadcast) run and overlap."""

    mode: Literal["async", "sync"] = "async"
    """``async``: lanes overlap, rollouts run ahead on slightly stale weights (bounded by
    ``max_staleness``). ``sync``: the same lanes with barriers (sample, then learn, then
    publish, then sample with the new weights), the baseline."""
    env_groups: int = bounded(2, ge=1)
    """Env groups per rollout rank, each a batched env of ``env.n_envs``; in async mode one
    group steps while the others wait for actions."""
    learner_ranks: int = bounded(1, ge=1)
    """Learner ranks (gradients averaged between them): rank 0, then ranks on its host,
    then on as few other hosts as possible (:func:`launch.placement.place`)."""
    colocate: bool = True
    """Learner ranks also run rollout lanes. With false they only learn and publish."""
    driver: Literal["threads", "serial"] = "threads"
    """``threads``: a thread per lane. ``serial`` (sync mode, one process): every lane in
    one thread, round-robin over their non-blocking steps; the deterministic reference."""
    max_staleness: int = bounded(1, ge=0)
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
    segment_len: int = bounded(0, ge=0)
    """PPO with ``independent_envs``: chunks of this many consecutive decisions of every env
    (a column runs across the env's resets and may start or end inside an episode; GAE
    bootstraps at its end and at truncations inside it), instead of one whole episode per
    column. Every env steps all the time (restarts are never held), so no env idles while
    the slowest episode of its chunk finishes, and episodes longer than a chunk are fine.
    0: one episode per column, ``env.episode_len`` decisions per chunk."""
    straggler_factor: float = bounded(2.0, gt=1)
    """A rollout rank whose env steps per second of sampling per env group fall below
    ``1/straggler_factor`` of the median rank's is a straggler: the learners name it in the
    metrics (``stragglers``, ``speed/rank<N>``), the log and the summary
    (:mod:`swimlane.adaptation.balance`)."""
    balance_window_s: float = bounded(10.0, gt=0)
    """The window over which the learners measure each rollout rank and env group."""
    rebalance: bool = False
    """Async mode, several rollout ranks: rank 0 plans every version, and the plan rides with
    the weights on the control plane. Each rank's share of its learner's chunks follows its
    measured speed (admission no longer holds fast ranks to the pace of the slowest), and a
    straggler hands one env group at a time (at most one per ``balance_window_s``) to the
    fastest rank with a spare one (``spare_groups``): its running batch is sent, then it
    parks, while the spare starts fresh episodes."""
    spare_groups: int = bounded(0, ge=0)
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
    mode, threads, ``learner_ranks`` >= 2, colocated, unsharded; :mod:`swimlane.adaptation.roles`).
    Rank 0 always learns; the other learner ranks start sampling. When rank 0's learner
    waits for chunks less than ``role_low`` of its time (learning is the bottleneck), the
    next one stops sampling and joins the learners; above ``role_high`` (the rollouts are),
    the last to join goes back. At most one switch per ``balance_window_s``, at a published
    version (the plan rides with the weights). Every learner rank takes part in every
    update; gradients are averaged over those with samples, so the weights are those of a
    fixed-role run and a switch moves no state. Each learner consumes ``chunks_per_update``
    chunks per version. ``fixed``: roles as placed at the start."""
    role_low: float = bounded(0.1, gt=0, lt=1)
    """Adaptive roles: below this share of its time waiting for chunks, rank 0's learner
    takes on another learner."""
    role_high: float = bounded(0.5, gt=0, lt=1)
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
    autotune_start_groups: int = bounded(0, ge=0)
    """Autotune: the env groups that step at the start (0: all ``env_groups``). The others
    are built and wait as spares, so that the manager can raise the count as well as lower
    it, up to ``env_groups``."""
    autotune_window_s: float = bounded(2.0, gt=0)
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
    chunks_per_update: int = bounded(1, ge=1)
    """Chunks (one env group's batch of episodes each) per learner update; ``sync`` mode
    uses one chunk from every rollout group instead."""
    broadcast_every: int = bounded(1, ge=1)
    """Publish weights after every N learner updates (sync mode needs 1)."""
    cuda_streams: bool = True
    """On CUDA, the inference and gradient lanes each run their device work on a stream of
    their own (inference at a higher priority), so that they overlap on one GPU. False: both
    queue on the default stream. No effect on the CPU."""
    publish_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """The dtype of the published weights: the learner's snapshot, the control plane's
    buckets and the inference replicas (which then sample under bf16 autocast). ``auto``:
    bf16 on CUDA, fp32 on the CPU. A sharded learner gathers each tensor in this dtype."""
    queue_size: int = bounded(4, ge=1)
    """Capacity of the chunk queue between sampling and learning (backpressure beyond)."""
    trace: bool = True
    """Record lane spans to ``trace.json`` in the run directory (``dvla trace`` draws them)."""
    max_env_failures: int = bounded(3, ge=1)
    """A simulator exception in an env group drops that group's batch of episodes and
    resets the group (counted as ``env_errors``); this many failures of one group in a
    row stop the run."""
    max_bad_updates: int = bounded(3, ge=1)
    """An update whose loss or gradient is not finite has its optimizer steps skipped
    (counted as ``updates_non_finite``); this many in a row stop the run with a report."""
    stall_timeout_s: float = bounded(600.0, ge=0)
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
    collective_backend: Literal["auto", "gloo"] = "auto"
    """``auto``: NCCL for CUDA tensors (weights, gradients) and gloo for CPU tensors.
    ``gloo``: gloo for everything, CUDA tensors included (staged through host memory), for
    ranks that share one GPU (NCCL needs a GPU per rank): the one-GPU suite's two-process
    job, or rollout ranks packed onto fewer GPUs."""
    collective_timeout_s: float = bounded(600.0, gt=0)
    """Longest a collective may wait for its peers, on every process group of the job (the
    default group, the learners', the control plane's), before the run fails. No collective
    waits for the next weights version (it is announced on the store first), so this bounds
    a transfer or an update's all-reduce, not the gap between versions."""
    gradient_nice: int = bounded(0, ge=0, le=19)
    """Niceness added to the gradient lane's thread (Linux; elsewhere ignored with a
    warning). Where lanes share too few CPU cores, simulation is the critical path and
    learning has slack: a positive value lets the kernel favour the sampling and inference
    lanes while all three want a core. 0 leaves scheduling alone."""

    def _validate(self) -> list[tuple[str, str]]:
        errs = []
        threads_async = self.mode == "async" and self.driver == "threads"
        if self.autotune and not threads_async:
            errs.append(("autotune", "needs swimlane.mode=async and driver=threads (sync rounds take every group)"))
        if self.take_turns and not threads_async:
            errs.append(("take_turns", "needs swimlane.mode=async and driver=threads (sync mode and the serial "
                                       "driver take turns already)"))
        if self.autotune_start_groups > self.env_groups:
            errs.append(("autotune_start_groups", f"must be in [0, env_groups={self.env_groups}], got "
                                                  f"{self.autotune_start_groups}"))
        elif self.autotune_start_groups and not self.autotune:
            errs.append(("autotune_start_groups", "needs swimlane.autotune=true (spare groups would never step)"))
        if self.spare_groups and not self.rebalance:
            errs.append(("spare_groups", "only rebalancing starts spare groups: set swimlane.rebalance=true"))
        if self.reissue and (self.mode != "sync" or self.driver != "threads" or self.independent_envs):
            errs.append(("reissue", "needs swimlane.mode=sync, driver=threads and independent_envs=false"))
        if self.rebalance and (not threads_async or self.autotune):
            errs.append(("rebalance", "needs swimlane.mode=async, driver=threads and autotune=false (autotune "
                                      "moves the env groups that step on its own)"))
        if self.roles == "adaptive" and (not threads_async or self.autotune or self.learner_ranks < 2
                                         or not self.colocate):
            errs.append(("roles", "adaptive needs swimlane.mode=async, driver=threads, autotune=false, "
                                  "learner_ranks >= 2 (the candidates) and colocate=true (they sample until they learn)"))
        if not self.role_low < self.role_high:
            errs.append(("role_low", f"needs 0 < role_low < role_high < 1, got {self.role_low} and {self.role_high}"))
        if self.segment_len and not self.independent_envs:
            errs.append(("segment_len", "needs swimlane.independent_envs=true (a column runs across its env's resets)"))
        if self.independent_envs and self.max_staleness < 2:
            errs.append(("max_staleness", "must be >= 2 with independent_envs (an episode may start while the "
                                          f"chunk before its own still fills), got {self.max_staleness}"))
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
