"""Which slice of the global vocabulary this rank's weight shard holds (VocabShard), and the layout a loss call is
told (VocabLayout)."""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import all_reduce_max, group_rank, group_size


@dataclass(frozen=True)
class VocabShard:
    start: int          # global id of this shard's first row
    size: int           # rows in this shard (padding included)
    global_size: int    # rows over all ranks (padding included)
    valid_size: int     # ids at or above this are padding: excluded from the softmax
    group: object = None

    @property
    def local_valid(self) -> int:
        """Rows of this shard that take part in the softmax (a prefix of the shard)."""
        return max(0, min(self.size, self.valid_size - self.start))

    @classmethod
    def build(cls, local_rows: int, group=None, vocab_start_index=None, valid_vocab_size=None):
        tp = group_size(group)
        start = group_rank(group) * local_rows if vocab_start_index is None else int(vocab_start_index)
        global_rows = local_rows * tp if vocab_start_index is None else _global_rows(start + local_rows, group)
        valid = global_rows if valid_vocab_size is None else int(valid_vocab_size)
        if valid <= 0 or valid > global_rows:
            raise ValueError(
                f"valid_vocab_size={valid_vocab_size} must be in [1, {global_rows}] (the vocabulary rows over all ranks)")
        return cls(start=start, size=local_rows, global_size=global_rows, valid_size=valid, group=group)


@dataclass(frozen=True)
class VocabLayout:
    """How the output layer's vocabulary and the hidden states are split over ranks, as a loss call is told it.

    tp_group: the ranks holding the vocabulary shards (None: one rank holds it all). sequence_parallel: the hidden
    states arrive as this rank's [s/tp, ...] sequence shard. vocab_start_index: the global id of this rank's first
    row (None: rank x rows, even shards). valid_vocab_size: ids at or above it are padding, left out of the softmax
    (None: every row is a token)."""
    tp_group: object = None
    sequence_parallel: bool = False
    vocab_start_index: int | None = None
    valid_vocab_size: int | None = None

    @property
    def seq_shards(self) -> int:
        """How many ranks the hidden states' sequence is split over (1 without sequence parallelism or at TP=1)."""
        return group_size(self.tp_group) if self.sequence_parallel else 1

    def shard(self, local_rows: int) -> VocabShard:
        """This rank's VocabShard for a weight of local_rows rows."""
        return VocabShard.build(local_rows, self.tp_group, self.vocab_start_index, self.valid_vocab_size)


def _global_rows(local_end: int, group) -> int:
    # Uneven layouts: the global vocabulary ends where the last shard ends.
    device = "cpu"
    if group_size(group) > 1 and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([float(local_end)], dtype=torch.float64, device=device)
    return int(all_reduce_max(t, group).item())
