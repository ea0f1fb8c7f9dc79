"""Teacher top-K over a vocab-parallel output layer: only O(N x K x tp) values cross ranks.

Each rank takes its local top-K, all ranks all-gather those K x tp candidates, and every rank picks
the same global top-K. Log-probs are taken against the TP-global log-sum-exp (all-reduce MAX + SUM).

Ties are broken by the smaller global id, through one int64 key per logit (value bits high, id low),
so the result does not depend on the TP layout or on torch.topk's tie order: a cache built at TP=1
and at TP=2 names the same ids whenever the two layouts produce the same logits.
"""
import torch
import torch.distributed as dist

from .comm import all_reduce_max, all_reduce_sum, group_size
from .limits import rows_per_chunk, temperature_problem
from .vocab import VocabShard

_LOW = 1 << 32
_EMPTY = torch.iinfo(torch.int64).min  # key of a padding candidate (a shard with fewer than K valid ids)


def _keys(u: torch.Tensor, start: int) -> torch.Tensor:
    """Order-preserving int64 keys: larger value first, then smaller global id."""
    bits = u.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    ids = torch.arange(start, start + u.shape[1], device=u.device, dtype=torch.int64)
    return ordered * _LOW + (_LOW - 1 - ids)


def _decode_keys(keys: torch.Tensor):
    empty = keys == _EMPTY
    ordered = torch.div(keys, _LOW, rounding_mode="floor")
    ids = (_LOW - 1) - (keys - ordered * _LOW)
    ordered = ordered.to(torch.int32)
    bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    vals = bits.view(torch.float32)
    return ids.masked_fill(empty, -1), vals.masked_fill(empty, float("-inf"))


def _all_gather_cat(t: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def vocab_parallel_topk(logits_shard, k, group=None, vocab_start_index=None, temperature=1.0,
                        valid_vocab_size=None):
    """Global top-K of softmax(logits / temperature) from this rank's vocab shard [N, V_local].

    Returns (ids int64 [N, K] global ids, logprobs float32 [N, K]), identical on every rank, sorted by
    log-prob descending (ties: smaller id first). Ids at or above valid_vocab_size (padding) never appear.
    """
    if logits_shard.dim() != 2:
        raise ValueError(f"logits_shard must be [N, V_local], got shape {tuple(logits_shard.shape)}")
    problem = temperature_problem(temperature)
    if problem:
        raise ValueError(f"temperature={temperature} {problem}")
    shard = VocabShard.build(logits_shard.shape[1], group, vocab_start_index, valid_vocab_size)
    k = int(k)
    if not 1 <= k <= shard.valid_size:
        raise ValueError(f"k={k} must be in [1, {shard.valid_size}] (the valid vocabulary size)")
    u = logits_shard[:, :shard.local_valid].float()
    if temperature != 1.0:
        u = u / float(temperature)
    n, width = u.shape
    if not torch.isfinite(u).all():
        raise ValueError("teacher logits contain NaN or inf; check the teacher's dtype and weights")

    keys = _keys(u, shard.start)
    kk = min(k, width)
    local = keys.topk(kk, dim=1).values if kk else keys[:, :0]
    if kk < k:
        local = torch.cat([local, local.new_full((n, k - kk), _EMPTY)], dim=1)
    best = _all_gather_cat(local, group).topk(k, dim=1).values
    ids, vals = _decode_keys(best)

    m = u.amax(dim=1) if width else u.new_full((n,), float("-inf"))
    m = all_reduce_max(m.contiguous(), group)
    # fp64 sum: the TP-split partial sums then round alike at any TP size.
    s = torch.exp(u - m[:, None]).sum(dim=1, dtype=torch.float64) if width else m.new_zeros(n, dtype=torch.float64)
    s = all_reduce_sum(s, group)
    lse = m.double() + torch.log(s)
    return ids, (vals.double() - lse[:, None]).float()


def topk_from_hidden(hidden, weight_shard, k, group=None, chunk_size=None, temperature=1.0,
                     vocab_start_index=None, valid_vocab_size=None):
    """vocab_parallel_topk of hidden [N, H] @ weight_shard[V_local, H].T, chunk_size rows at a time.

    Only one [chunk, V_local] logit block exists at a time. Every rank of the group must pass the same N.
    """
    if hidden.dim() != 2 or weight_shard.dim() != 2 or hidden.shape[1] != weight_shard.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight_shard [V_local, H]; got {tuple(hidden.shape)} and "
                         f"{tuple(weight_shard.shape)} (pass the output layer's weight, not its transpose)")
    n = hidden.shape[0]
    step = int(chunk_size or rows_per_chunk(weight_shard.shape[0]))  # plus 2x its bytes in int64 keys
    ids, logp = [], []
    w = weight_shard.to(hidden.dtype)
    for a in range(0, n, step):
        logits = hidden[a:a + step] @ w.t()
        i, lp = vocab_parallel_topk(logits, k, group, vocab_start_index, temperature, valid_vocab_size)
        ids.append(i)
        logp.append(lp)
        del logits
    if not ids:
        return (torch.empty(0, int(k), dtype=torch.int64, device=hidden.device),
                torch.empty(0, int(k), dtype=torch.float32, device=hidden.device))
    return torch.cat(ids), torch.cat(logp)
