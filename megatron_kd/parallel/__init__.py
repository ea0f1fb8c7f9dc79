"""Tensor- and sequence-parallel pieces: vocab shards, the few collectives the loss needs, the vocab-parallel
top-K, and the limits they share (limits.py, importable without torch)."""
_NAMES = {"VocabShard": "vocab", "VocabLayout": "vocab", "all_reduce_max": "comm", "all_reduce_sum": "comm",
          "group_size": "comm", "group_rank": "comm", "gather_sequence": "sequence", "vocab_parallel_topk": "topk",
          "topk_from_hidden": "topk"}
__all__ = list(_NAMES)


def __getattr__(name):
    # the submodules load torch; `megatron_kd.parallel.limits` alone must not
    if name in _NAMES:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
