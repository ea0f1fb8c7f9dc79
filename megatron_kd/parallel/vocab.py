"""Which slice of the global vocabulary this rank's weight shard holds."""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import all_reduce_max, group_rank, group_size

# Logits of one chunk over a vocabulary shard: 2**26 elements (256 MiB in fp32). Big enough for efficient GEMMs,
# small enough that a chunked pass (the torch loss impls, the teacher's top-K) stays a few hundred MiB above its
# inputs. The planner counts the same chunk.
LOGITS_PER_CHUNK = 1 << 26


def rows_per_chunk(vocab_local: int) -> int:
    """Rows of a [rows, vocab_local] logit chunk that hold about LOGITS_PER_CHUNK elements (at least one)."""
    return max(1, LOGITS_PER_CHUNK // max(1, vocab_local))


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


def _global_rows(local_end: int, group) -> int:
    # Uneven layouts: the global vocabulary ends where the last shard ends.
    device = "cpu"
    if group_size(group) > 1 and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([float(local_end)], dtype=torch.float64, device=device)
    return int(all_reduce_max(t, group).item())
