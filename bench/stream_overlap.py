"""Inference and learning at once on one device: each lane on a CUDA stream of its own
(``swimlane.cuda_streams=true``) against both on the default stream, one run.

Builds ``token_vla`` at ``--size`` (random init) on ``--device``: a learner and an inference
replica, as a colocated rank holds them. Two threads, as the swimlane's lanes: one samples
actions for ``--infer-batch`` observations ``--infer`` times, one makes ``--updates`` GRPO
updates of a ``--samples`` batch (updates per round); each wraps its device work in
:meth:`swimlane.lanes.streams.LaneStream.use` (the lanes' own code), with streams on or off.
Prints, per mode, the wall time of both threads together and the overlap (the two lanes'
times alone over their time together: 1.0 = no overlap, 2.0 = perfect), median of
``--repeats`` alternating rounds, then ``ratio streams/default``. On the CPU streams do not
exist and the two modes run the same code (a smoke test of the bench).

    python bench/stream_overlap.py --size 0.5b --device cuda
    python bench/stream_overlap.py --size tiny --device cpu --samples 8 --infer 4 --updates 2   # smoke
"""

from __future__ import annotations

import copy
import statistics
import threading
import time

import torch
from learner_step import build_model, make_batch, model_args, sync  # bench/ is on the path when run

from dvla.algos import build_algorithm
from dvla.config import AlgoConfig
from dvla.types import Observation
from swimlane.lanes.streams import LaneStream


def main() -> None:
    ap = model_args(__doc__)
    ap.add_argument("--infer-batch", type=int, default=64, help="observations per forward pass")
    ap.add_argument("--infer", type=int, default=20, help="forward passes per round")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    policy = build_model(args)
    replica = copy.deepcopy(policy).requires_grad_(False)
    batch = make_batch(policy, args.samples, args.image, device)
    g = torch.Generator().manual_seed(3)
    obs = replica.prepare(Observation(
        image=torch.randint(0, 256, (args.infer_batch, 3, args.image, args.image), dtype=torch.uint8, generator=g),
        proprio=torch.randn(args.infer_batch, 8, generator=g), instruction=["pick up the cube"] * args.infer_batch))
    algo = build_algorithm(AlgoConfig(name="grpo", group_size=4, update_epochs=1, minibatches=1, lr=1e-6,
                                      precision="bf16" if device.type == "cuda" else "fp32"), policy)

    def infer(stream: LaneStream) -> None:
        for _ in range(args.infer):
            with stream.use():
                replica.act(obs)

    def learn(stream: LaneStream) -> None:
        for i in range(args.updates):
            with stream.use():
                algo.update(batch, torch.Generator().manual_seed(i))

    def timed(fn) -> float:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    def round_(streams: bool) -> tuple[float, float]:
        s_inf, s_learn = LaneStream(device, streams, high_priority=True), LaneStream(device, streams)
        alone = timed(lambda: infer(s_inf)) + timed(lambda: learn(s_learn))

        def both() -> None:
            t = threading.Thread(target=infer, args=(s_inf,))
            t.start()
            learn(s_learn)
            t.join()

        together = timed(both)
        return together, alone / together

    round_(True)  # warm-up: kernels, allocator
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(args.repeats):
        for streams in ((True, False) if i % 2 == 0 else (False, True)):
            results[streams].append(round_(streams))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"token_vla size={args.size} on {name}: {args.infer} forward passes of {args.infer_batch} beside "
          f"{args.updates} updates of {args.samples} samples, median of {args.repeats} alternating rounds")
    wall = {}
    for streams, rs in results.items():
        wall[streams] = statistics.median(r[0] for r in rs)
        overlap = statistics.median(r[1] for r in rs)
        print(f"{'streams' if streams else 'default'}: {wall[streams] * 1e3:9.1f} ms together, overlap {overlap:.2f}x")
    print(f"ratio streams/default = {wall[False] / wall[True]:.2f}  (wall time of both lanes, default over streams)")


if __name__ == "__main__":
    main()
