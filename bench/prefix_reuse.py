"""Decision time of ``pi0_vla`` with the prefix computed once per decision against recomputed
at every denoising step, one process.

``cached`` is the policy as it acts: one pass of the VLM prefix (vision tower and LM) keeps
each layer's keys and values, then each of the ``--steps`` denoising steps runs only the
action expert over that cache (``Pi0Expert``). ``recomputed`` runs, at every step, one pass
over the whole sequence (prefix, state, actions) under the block-causal mask
(``Pi0VLA.joint_velocity``), as a flow VLA without a KV cache does. Both draw the same chain
from the same noise (the largest difference of their actions is printed).

For each size (``tiny``, and ``mid``: a 4-layer 256-wide vision tower at 64 px, a 6-layer
512-wide LM and a 256-wide expert, 32M parameters), the two are timed ``--repeats`` times in
alternating order after a warm-up; prints the medians and recomputed / cached.

    python bench/prefix_reuse.py                              # tiny and mid, 10 steps, batch 8
    python bench/prefix_reuse.py --sizes mid --steps 10 --batch 8 --repeats 7 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dvla.heads.flow import FlowMatchingHead
from dvla.policy import PolicySpec, build_policy
from dvla.types import Observation

SHAPES = {
    "tiny": {"vision": {"image_size": 32}},
    "mid": {"vision": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
                       "num_attention_heads": 4, "patch_size": 8, "image_size": 64},
            "lm": {"width": 512, "mlp": 2048, "layers": 6, "heads": 8, "kv_heads": 1, "head_dim": 64},
            "expert": {"width": 256, "mlp": 1024, "heads": 4}},
}


def observation(policy, batch: int, side: int) -> Observation:
    g = torch.Generator().manual_seed(0)
    words = ["pick up the red cube", "move to the blue target", "open the drawer", "lift it"]
    obs = Observation(image=torch.randint(0, 256, (batch, 3, side, side), dtype=torch.uint8, generator=g),
                      proprio=torch.randn(batch, 8, generator=g), instruction=[words[i % 4] for i in range(batch)])
    return policy.preprocess(policy.prepare(obs))


@torch.no_grad()
def decide_cached(policy, obs, seed: int):
    return policy(obs).dist.draw(generator=torch.Generator().manual_seed(seed)).actions


@torch.no_grad()
def decide_recomputed(policy, obs, seed: int):
    head = policy.action_head
    full = FlowMatchingHead(lambda x, t, _: policy.joint_velocity(obs, x, t)[0], head.k, head.d, steps=head.steps)
    full.log_sigma = head.log_sigma
    return full(None, batch_size=obs.batch_size).draw(generator=torch.Generator().manual_seed(seed)).actions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "mid"], choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=10, help="denoising steps (pi0: 10)")
    p.add_argument("--batch", type=int, default=8, help="decisions per call")
    p.add_argument("--chunk", type=int, default=8, help="actions per chunk")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"pi0_vla decision time, batch {args.batch}, chunk {args.chunk}, {args.steps} steps, "
          f"{args.threads} thread(s), median of {args.repeats}")
    for size in args.sizes:
        torch.manual_seed(0)
        policy = build_policy("pi0_vla", PolicySpec((3, 64, 64), 8, 7, args.chunk),
                              {**SHAPES[size], "flow_steps": args.steps, "max_tokens": 16}).eval()
        obs = observation(policy, args.batch, 64)
        n_params = sum(q.numel() for q in policy.parameters())
        gap = (decide_cached(policy, obs, 1) - decide_recomputed(policy, obs, 1)).abs().max().item()  # + warm-up
        times = {"cached": [], "recomputed": []}
        for r in range(args.repeats):
            order = ("cached", "recomputed") if r % 2 == 0 else ("recomputed", "cached")
            for name in order:
                fn = decide_cached if name == "cached" else decide_recomputed
                t0 = time.perf_counter()
                fn(policy, obs, r)
                times[name].append(time.perf_counter() - t0)
        c, f = statistics.median(times["cached"]), statistics.median(times["recomputed"])
        tokens = policy.encode_prefix(obs)[0].mask.shape[1]
        print(f"{size:5s} {n_params / 1e6:6.2f}M params, prefix {tokens} tokens: cached {c * 1e3:8.1f} ms  "
              f"recomputed {f * 1e3:8.1f} ms  ratio {f / c:5.2f}x  (actions differ by {gap:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
