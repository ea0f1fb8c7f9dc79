"""Tensor- and sequence-parallel pieces: vocab shards and the few collectives the loss needs."""
from .comm import all_reduce_max, all_reduce_sum, group_size, group_rank
from .sequence import gather_sequence, scatter_sequence
from .vocab import VocabShard

__all__ = [
    "VocabShard", "all_reduce_max", "all_reduce_sum", "group_size", "group_rank",
    "gather_sequence", "scatter_sequence",
]
