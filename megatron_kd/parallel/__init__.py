"""Tensor- and sequence-parallel pieces: vocab shards and the few collectives the loss needs."""
from .comm import all_reduce_max, all_reduce_sum, group_size, group_rank
from .sequence import gather_sequence
from .topk import topk_from_hidden, vocab_parallel_topk
from .vocab import VocabShard

__all__ = [
    "VocabShard", "all_reduce_max", "all_reduce_sum", "group_size", "group_rank",
    "gather_sequence", "vocab_parallel_topk", "topk_from_hidden",
]
