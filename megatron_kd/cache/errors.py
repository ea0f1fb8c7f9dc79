"""One exception type for every cache problem (its home: megatron_kd/errors.py, with the package's others)."""
from ..errors import CacheError

__all__ = ["CacheError"]
