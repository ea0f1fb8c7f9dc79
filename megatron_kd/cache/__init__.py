"""Offline teacher top-K cache: build once with any teacher layout, train with any student layout.

Format spec and data-flow choice: docs/cache-format.md.
"""
from .build import build_cache
from .dataset import TopKDataset, collate_topk
from .errors import CacheError
from .reader import CacheReader
from .teacher import CallableTeacher, HFTeacher, TeacherOutput
from .verify import inspect_cache, verify_cache
from .writer import CacheWriter

__all__ = ["CacheReader", "CacheWriter", "build_cache", "TopKDataset", "collate_topk", "verify_cache",
           "inspect_cache", "CacheError", "CallableTeacher", "HFTeacher", "TeacherOutput"]
