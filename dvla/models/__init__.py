"""Built-in policies. Importing this package registers them."""

from dvla.models.pi0_vla import Pi0VLA
from dvla.models.tiny_vla import TinyVLA
from dvla.models.token_vla import TokenVLA

__all__ = ["Pi0VLA", "TinyVLA", "TokenVLA"]
