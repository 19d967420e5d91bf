"""Learner throughput of a transformer VLA (``token_vla``): bf16 autocast (and, with
``--fsdp``, an FSDP2-sharded bf16 learner) against fp32, one run.

Builds ``token_vla`` at ``--size`` (random init) on ``--device``, draws one batch of
``--samples`` decisions with the policy itself (synthetic observations: random images,
the built-in tokenizer's instructions, random proprio), and times GRPO updates of that
batch (``--updates`` after one warm-up), alternating fp32 and ``algo.precision=bf16``.
``--fsdp`` adds ``algo.shard=fsdp`` with bf16 (``dvla/distributed/sharding.py``: one FSDP unit per
transformer block) over a process group of this one process, or of the torchrun world (each
rank then learns from the same batch): the sharded code path on one GPU.

Prints, per precision, the median update time, the tokens per second the learner processes
(sequence positions through the LM: image patches + instruction + state + action tokens,
per sample and pass), the model FLOP/s (6 x trainable parameters x tokens, forward and
backward, plus 2 x frozen ones) and, on a GPU of known peak, the MFU; then bf16/fp32.

    python bench/learner_step.py --size 0.5b --device cuda --samples 64 --micro-batch 16
    python bench/learner_step.py --size tiny --device cpu --samples 32 --updates 2   # smoke
    python bench/learner_step.py --size 0.5b --device cuda --samples 64 --micro-batch 16 --fsdp
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch

import torch.distributed as dist

from dvla.algos import build_algorithm
from dvla.config import AlgoConfig
from dvla.distributed import default_backend, init_from_env
from dvla.policy import PolicySpec, VLAPolicy, build_policy
from dvla.distributed.sharding import shard_learner
from dvla.types import Observation, RolloutBatch

# Dense bf16 peak FLOP/s by device name (vendor figures, without sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def peak_of(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def make_batch(policy, samples: int, image: int, device: torch.device) -> RolloutBatch:
    """One decision per sample (T=1), sampled by the policy: what a learner receives."""
    g = torch.Generator().manual_seed(0)
    words = ["pick up the red cube", "open the top drawer", "put the bowl on the plate", "close the microwave"]
    obs = Observation(image=torch.randint(0, 256, (samples, 3, image, image), dtype=torch.uint8, generator=g),
                      proprio=torch.randn(samples, policy.spec.proprio_dim, generator=g),
                      instruction=[words[i % len(words)] for i in range(samples)])
    prepared = policy.prepare(obs)
    with torch.no_grad():
        out = policy.act(prepared, generator=torch.Generator(device=device).manual_seed(1)
                         if device.type == "cuda" else torch.Generator().manual_seed(1))
    k = policy.spec.action_chunk
    ones = torch.ones(1, samples, dtype=torch.bool)
    return RolloutBatch(
        image=obs.image.unsqueeze(0), proprio=obs.proprio.unsqueeze(0), instruction_ids=prepared.instruction_ids.cpu(),
        instruction_mask=prepared.instruction_mask.cpu(), actions=out.actions.cpu().unsqueeze(0),
        log_probs=out.log_probs.cpu().unsqueeze(0), values=torch.zeros(2, samples),
        rewards=torch.rand(1, samples, generator=g), terminated=ones, truncated=~ones, valid=ones,
        policy_version=torch.zeros(1, samples, dtype=torch.long), success=ones[0],
        group_ids=torch.arange(samples) // 4, action_valid=torch.ones(1, samples, k, dtype=torch.bool),
        action_log_probs=out.log_prob_elements.cpu().unsqueeze(0), bootstrap=torch.zeros(1, samples),
        episode_sums=torch.tensor([[1.0, 1.0, 0.0, 1.0]]).expand(samples, 4).clone(),
        extras={n: v.cpu().unsqueeze(0) for n, v in out.extras.items()})


def model_args(doc: str) -> argparse.ArgumentParser:
    """The options of a bench that builds ``token_vla`` and a learner batch (this one and
    bench/stream_overlap.py)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=["tiny", "0.5b", "7b"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--samples", type=int, default=64, help="decisions in a learner batch")
    ap.add_argument("--updates", type=int, default=3, help="timed learner updates")
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--action-dim", type=int, default=7)
    return ap


def build_model(args) -> VLAPolicy:
    """``token_vla`` at ``--size`` (random init) on ``--device``, in eval mode."""
    torch.manual_seed(0)
    spec = PolicySpec((3, args.image, args.image), 8, args.action_dim, 1)
    options = {"size": args.size, "n_bins": 256}
    if args.size == "tiny":
        options["vision"] = {"image_size": args.image}
    return build_policy("token_vla", spec, options).to(args.device).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = model_args(__doc__)
    ap.add_argument("--micro-batch", type=int, default=0, help="algo.micro_batch (0: the whole minibatch)")
    ap.add_argument("--fsdp", action="store_true", help="also time an FSDP2-sharded bf16 learner")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.fsdp:
        join_group(device)
    policy = build_model(args)
    batch = make_batch(policy, args.samples, args.image, device)
    n_patches = (policy.image_size // policy.vision.config.patch_size) ** 2
    tokens_per_sample = n_patches + batch.instruction_ids.shape[1] + 1 + args.action_dim
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in policy.parameters() if not p.requires_grad)
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    times: dict[str, list[float]] = {"fp32": [], "bf16": [], **({"fsdp-bf16": []} if args.fsdp else {})}
    algos = {}
    for precision in times:
        cfg = AlgoConfig(name="grpo", group_size=4, update_epochs=1, minibatches=1, lr=1e-5,
                         micro_batch=args.micro_batch, precision="fp32" if precision == "fp32" else "bf16",
                         shard="fsdp" if precision == "fsdp-bf16" else "none")
        if cfg.shard == "fsdp":  # a copy of its own, sharded (its weights are never reset)
            algos[precision] = build_algorithm(cfg, copy.deepcopy(policy))
            shard_learner(algos[precision], dist.group.WORLD)
        else:
            algos[precision] = build_algorithm(cfg, policy)
    for i in range(args.updates + 1):  # the first round warms up
        order = list(times) if i % 2 == 0 else list(times)[::-1]
        for precision in order:
            if precision != "fsdp-bf16":
                policy.load_state_dict(state)
            sync(device)
            t0 = time.perf_counter()
            algos[precision].update(batch, torch.Generator().manual_seed(i))
            sync(device)
            if i:
                times[precision].append(time.perf_counter() - t0)
    peak = peak_of(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"token_vla size={args.size}: {trainable / 1e6:.2f}M trainable + {frozen / 1e6:.2f}M frozen parameters, "
          f"{args.samples} samples x {tokens_per_sample} tokens, micro_batch={args.micro_batch}, device={name}")
    med = {}
    for precision, ts in times.items():
        med[precision] = statistics.median(ts)
        tok_s = args.samples * tokens_per_sample / med[precision]
        flops = (6 * trainable + 2 * frozen) * tok_s
        mfu = f"  MFU {flops / peak:.1%} of {peak / 1e12:.0f} TFLOP/s" if peak else ""
        print(f"{precision}: {med[precision] * 1e3:8.1f} ms/update  {tok_s:10.0f} tokens/s  "
              f"{flops / 1e12:7.2f} TFLOP/s{mfu}")
    print(f"ratio bf16/fp32 = {med['fp32'] / med['bf16']:.2f}  (update speed-up, same batch, median of "
          f"{args.updates} alternating)")
    if args.fsdp:
        print(f"ratio fsdp-bf16/fp32 = {med['fp32'] / med['fsdp-bf16']:.2f}  (FSDP2 over {dist.get_world_size()} "
              f"rank(s), bf16 parameters and compute, fp32 reductions)")
        dist.destroy_process_group()


def join_group(device: torch.device) -> None:
    """The torchrun world, or a process group of this one process, with the backends the
    product's default group has (:func:`dvla.distributed.default_backend`): on CUDA NCCL for
    CUDA tensors and gloo for CPU ones (``cpu:gloo,cuda:nccl``), else gloo. The sharded
    learner's group is that group (WORLD), as the product's learner group takes the default
    group's backends (swimlane/assembly/build.py ``build_groups``)."""
    if "RANK" in os.environ:  # torchrun: as the launcher joins (interfaces, the rank's device)
        init_from_env(device=str(device))
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group(default_backend(str(device)), store=store, rank=0, world_size=1)


if __name__ == "__main__":
    main()
