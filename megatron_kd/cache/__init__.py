"""Offline teacher top-K cache: its format, writer, reader, dataset and checks (built by megatron_kd.teacher.build).

Format spec and data-flow choice: docs/cache-format.md.
"""
from .dataset import TopKDataset, collate_topk
from .errors import CacheError
from .reader import CacheReader
from .verify import inspect_cache, verify_cache
from .writer import CacheWriter

__all__ = ["CacheReader", "CacheWriter", "TopKDataset", "collate_topk", "verify_cache", "inspect_cache", "CacheError"]
