"""Transport planes.

* ``planes.serial``: the data plane's wire format (msgpack envelope, a packed frame of small tensors, raw frames of large ones).
* ``planes.data``: trajectories over ZeroMQ (PUSH/PULL), with backpressure and liveness.
* ``planes.control``: versioned, bucketed weight broadcast over torch.distributed.
"""

from planes.serial import PROTOCOL_VERSION, MessageError, decode, encode

__all__ = ["PROTOCOL_VERSION", "MessageError", "decode", "encode"]
