"""Built-in policies. Importing this package registers them."""

from dvla.models.tiny_vla import TinyVLA
from dvla.models.token_vla import TokenVLA

__all__ = ["TinyVLA", "TokenVLA"]
