"""Offline teacher top-K cache: its format, writer, reader, dataset and checks (built by megatron_kd.teacher.build).

Format spec and data-flow choice: docs/cache-format.md.

The names below are imported on first use: a light submodule (cache.encoding, whose registry gives the command
line its flags) must not pull in torch through the dataset, or `megatron-kd cache --help` takes seconds.
"""
import importlib

_HOMES = {"TopKDataset": "dataset", "collate_topk": "dataset", "CacheError": "errors", "CacheReader": "reader",
          "inspect_cache": "verify", "verify_cache": "verify", "CacheWriter": "writer"}
__all__ = ["CacheReader", "CacheWriter", "TopKDataset", "collate_topk", "verify_cache", "inspect_cache", "CacheError"]


def __getattr__(name):
    if name in _HOMES:
        value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
