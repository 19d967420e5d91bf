"""Built-in policies. Importing this package registers them."""

from dvla.models.tiny_vla import TinyVLA

__all__ = ["TinyVLA"]
