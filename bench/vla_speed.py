"""Rollout decisions and learner updates per second of the built-in VLAs in bf16 against fp32.

For each of ``--policies`` (``token_vla``, ``pi0_vla``), built at ``--size`` with random
weights on ``--device`` (``mid``: token_vla 0.5B and pi0_vla 3B, images 224; ``tiny``: both
tiny), times in one run, alternating the two precisions and taking medians:

* rollout decisions: ``policy.act`` on a batch of ``--batch`` observations (synthetic images,
  the built-in tokenizer's instructions, random proprio), fp32 against bf16 autocast;
* learner updates: one GRPO update of ``--samples`` decisions the policy itself sampled,
  ``algo.precision=fp32`` against ``bf16``.

Prints decisions/s and samples/s per precision and ``ratio bf16/fp32`` of each.

    python bench/vla_speed.py --device cuda --size mid
    python bench/vla_speed.py --device cpu --size tiny --batch 4 --samples 4 --repeats 1
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from learner_step import make_batch, sync  # noqa: E402

from dvla.algos import build_algorithm  # noqa: E402
from dvla.config import AlgoConfig  # noqa: E402
from dvla.policy import PolicySpec, build_policy  # noqa: E402
from dvla.types import Observation  # noqa: E402
from memory import runtime  # noqa: E402

MID = {"token_vla": "0.5b", "pi0_vla": "3b"}


def build(name: str, size: str, image: int, device: torch.device):
    options = {"size": size}
    if name == "token_vla":
        options["n_bins"] = 256
    if size == "tiny":
        options["vision"] = {"image_size": image}
    torch.manual_seed(0)
    with torch.device(device):  # the weights made where they are used (a 3B model's init on the CPU is slow)
        policy = build_policy(name, PolicySpec((3, image, image), 8, 7, 4), options)
    return policy.to(device)


def observations(policy, n: int, image: int) -> Observation:
    g = torch.Generator().manual_seed(0)
    words = ["pick up the red cube", "open the top drawer", "put the bowl on the plate", "close the microwave"]
    return Observation(image=torch.randint(0, 256, (n, 3, image, image), dtype=torch.uint8, generator=g),
                       proprio=torch.randn(n, 8, generator=g), instruction=[words[i % 4] for i in range(n)])


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def timed_rounds(run, repeats: int, device: torch.device, before=None) -> dict[str, list[float]]:
    """Seconds of ``run(precision, round)`` for fp32 and bf16, alternating their order each
    round; the first round warms up. ``before()`` runs untimed before each call."""
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for i in range(repeats + 1):
        for precision in (list(times) if i % 2 == 0 else list(times)[::-1]):
            if before is not None:
                before()
            sync(device)
            t0 = time.perf_counter()
            run(precision, i)
            sync(device)
            if i:
                times[precision].append(time.perf_counter() - t0)
    return times


def measure(name: str, args) -> dict:
    device = torch.device(args.device)
    size = MID[name] if args.size == "mid" else "tiny"
    image = 224 if size != "tiny" else args.image
    policy = build(name, size, image, device).eval()
    prepared = policy.prepare(observations(policy, args.batch, image))
    gen = torch.Generator(device=device).manual_seed(1)

    def act_once(precision: str, _round: int) -> None:
        with torch.no_grad(), autocast(device, precision):
            policy.act(prepared, generator=gen)

    act = timed_rounds(act_once, args.repeats, device)
    batch = make_batch(policy, args.samples, image, device)
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    algos = {p: build_algorithm(AlgoConfig(name="grpo", group_size=4, update_epochs=1, minibatches=1, lr=1e-5,
                                           precision=p), policy) for p in ("fp32", "bf16")}

    def update_once(precision: str, i: int) -> None:
        algos[precision].update(batch, torch.Generator().manual_seed(i))

    learn = timed_rounds(update_once, args.repeats, device, before=lambda: policy.load_state_dict(state))
    params = sum(p.numel() for p in policy.parameters())
    return {"size": size, "params": params, "act": {p: args.batch / statistics.median(t) for p, t in act.items()},
            "learn": {p: args.samples / statistics.median(t) for p, t in learn.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="token_vla,pi0_vla")
    ap.add_argument("--size", default="mid", choices=["mid", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=32, help="observations per act call")
    ap.add_argument("--samples", type=int, default=16, help="decisions in a learner batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--image", type=int, default=32, help="image side of the tiny models")
    args = ap.parse_args()
    rt = runtime.for_device(args.device)  # (every CUDA call through the rank's runtime, as dvla's own)
    rt.bind_thread()
    name = rt.device_name(0) if args.device.startswith("cuda") else "cpu"
    for policy in args.policies.split(","):
        r = measure(policy, args)
        print(f"{policy} size={r['size']} ({r['params'] / 1e6:.1f}M parameters) on {name}: "
              f"act {r['act']['fp32']:.1f} / {r['act']['bf16']:.1f} decisions/s fp32 / bf16 (batch {args.batch}), "
              f"learner {r['learn']['fp32']:.1f} / {r['learn']['bf16']:.1f} samples/s (batch {args.samples})")
        print(f"{policy} ratio bf16/fp32 = act {r['act']['bf16'] / r['act']['fp32']:.2f}, learner "
              f"{r['learn']['bf16'] / r['learn']['fp32']:.2f}  (medians of {args.repeats}, alternating)", flush=True)
        rt.empty_cache()  # (the model of the last policy is gone: its memory back before the next)
    return 0


if __name__ == "__main__":
    sys.exit(main())
