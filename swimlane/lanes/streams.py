"""A CUDA stream per lane, so that inference and learning overlap on one GPU.

Every thread that never picks a stream uses the device's default stream, so the kernels of
the inference and gradient lanes queue behind each other in one stream even though the
lanes run in threads of their own. With ``swimlane.cuda_streams`` each of the two runs its
device work in a stream of its own (inference at a higher priority: an env group waits on
its actions) and the GPU interleaves them.

The rule that keeps it correct: a lane's device work is complete when it hands a result to
another lane. :meth:`LaneStream.use` runs a block on the lane's stream and waits for that
stream at the end of it (only the lane's own thread waits; the other stream keeps going).
Tensors a lane hands over are marked as used by the consumer's stream
(:meth:`LaneStream.hand_over`), so that the caching allocator does not give their memory
to the producer again while the consumer still reads it. Weights written into a standby
replica are complete before it is marked ready (:class:`swimlane.lanes.weights.DoubleBufferedWeights`).
On the CPU (or with the option off) all of this is a no-op.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from memory import runtime


class LaneStream:
    def __init__(self, device: torch.device, enabled: bool = True, high_priority: bool = False):
        """``high_priority``: the stream runs at the device's highest priority (else its
        lowest, the default). The range differs by GPU: (0, -1) on many, (0, -5) on Hopper, so
        the two ends are asked of the runtime rather than named. Streams come from the rank's
        device runtime (memory/runtime.py): none on the CPU."""
        self.device = device
        self.rt = runtime.for_device(device)
        self.stream = None
        self._streams: dict = {}  # high priority? -> stream
        self._high = False
        if enabled and self.rt.accelerated:
            self._lowest, self._highest = self.rt.priority_range()  # (0, -n): lower is higher priority
            self._high = high_priority and self._highest != self._lowest
            self.stream = self._streams[self._high] = self.rt.new_stream(
                self._highest if self._high else self._lowest)

    @property
    def can_prioritise(self) -> bool:
        """Whether :meth:`set_high_priority` has two priorities to choose from (CUDA only)."""
        return self.stream is not None and self._lowest != self._highest

    @property
    def high_priority(self) -> bool:
        return self.stream is not None and self._high

    def set_high_priority(self, high: bool) -> None:
        """Run the following blocks on a stream of the highest (or the lowest) priority. A
        block in progress finishes on its stream (:meth:`use` waits for it at the end), so
        the switch needs no synchronisation. (``swimlane.autotune`` moves it.)"""
        if not self.can_prioritise:
            raise OSError("stream priorities need a CUDA stream with a priority range")
        if high not in self._streams:
            self._streams[high] = self.rt.new_stream(self._highest if high else self._lowest)
        self.stream, self._high = self._streams[high], high

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Run the block's device work on this stream; on leaving, wait until it is done."""
        stream = self.stream  # (a priority switch takes effect at the next block)
        if stream is None:
            yield
            return
        # The stream starts after what the thread's current stream already queued.
        try:
            with self.rt.use_stream(stream):
                yield
        finally:
            self.rt.synchronize(stream)

    def hand_over(self, tensors) -> None:
        """Mark device ``tensors`` made on this stream as used by the default stream, where
        the other lanes consume them."""
        if self.stream is None:
            return
        consumer = self.rt.default_stream()
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.rt.record_stream(t, consumer)


def tensors_of(obj) -> list[torch.Tensor]:
    """The tensors of an inference reply (an ActOutput's fields, or a tensor)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    out = []
    for v in vars(obj).values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            out.extend(t for t in v.values() if isinstance(t, torch.Tensor))
    return out
