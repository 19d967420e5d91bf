"""Transport planes. ``planes.serial``: the data plane's msgpack + raw-frame wire format."""

from planes.serial import PROTOCOL_VERSION, MessageError, decode, encode

__all__ = ["PROTOCOL_VERSION", "MessageError", "decode", "encode"]
