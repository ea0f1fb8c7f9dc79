"""N draws per row from the teacher's full softmax(logits / T) over a vocab-parallel output layer, without
gathering [rows x V]: only O(rows x (tp + N)) values cross ranks.

The draws are an inverse-CDF over integer weights, so every TP layout, chunking and micro-batching picks the same
ids bit for bit:
- each id's weight is w = trunc(exp(u - m) * 2**32) as int64, u = logit / T in fp32, m the TP-global row max (an
  all-reduce MAX: exact). An id's weight depends only on its own logit and m, and integer sums are exact in any
  order, so the cumulative weights over the global vocabulary are the same numbers at TP=1 and TP=2. Ids whose
  probability is below 2**-32 of the row's largest get weight 0 (at most V * 2**-32 of the mass: 5e-5 at
  V=201,088, in the worst case where every other id sits just under that bound);
- draw d of a row takes t = floor(U * W), W = the row's total weight (< 2**53, exact in float64), U uniform in
  [0, 1) from a counter-based hash of (seed, sample index, position, d) alone (mix64 below: splitmix64's
  finalizer), so no generator state exists to depend on layout, resume point or device;
- the rank whose slice of the cumulative weights holds t (ranks ordered by their first vocabulary id) finds the id
  with a binary search of its shard's int64 cumulative sum; the others contribute -1; an all-reduce MAX gives every
  rank the ids.
Each draw is id v with probability w_v / W: the teacher's softmax at temperature T up to the 2**-32 truncation.
"""
import numpy as np
import torch

from .comm import all_reduce_max
from ..rules import temperature_problem
from .topk import _all_gather_cat, hidden_source, logits_source
from .vocab import VocabShard

WEIGHT_SCALE = 2.0 ** 32
MAX_DRAWS = 4096   # draws per position (the encoding stores N bits of multiplicities per position)
_MAX_VOCAB = 1 << 20  # W < V * 2**32 must stay below 2**53 (exact in float64)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


# splitmix64 (Steele, Lea, Flood 2014): a bijection of 64-bit words whose outputs pass BigCrush as a counter hash
_GOLDEN, _C1, _C2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 of int64 words (two's complement wrap-around, as uint64 arithmetic)."""
    z = z + _signed(_GOLDEN)
    z = (z ^ _srl(z, 30)) * _signed(_C1)
    z = (z ^ _srl(z, 27)) * _signed(_C2)
    return z ^ _srl(z, 31)


def uniforms(seed: int, sample: torch.Tensor, position: torch.Tensor, draws: int) -> torch.Tensor:
    """float64 [n, draws] in [0, 1): U of draw d at row (sample[r], position[r]); 53 random bits each."""
    row = mix64(mix64(mix64(torch.full_like(sample, int(seed))) ^ sample) ^ position)
    d = mix64(torch.arange(draws, dtype=torch.int64, device=sample.device) + (1 << 40))
    z = mix64(row[:, None] ^ d[None, :])
    return _srl(z, 11).double() * 2.0 ** -53


def uniforms_reference(seed: int, sample, position, draws: int) -> np.ndarray:
    """The same values with numpy uint64 arithmetic (the tests' reference)."""
    def mix(z):
        with np.errstate(over="ignore"):
            z = z + np.uint64(_GOLDEN)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(_C1)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(_C2)
            return z ^ (z >> np.uint64(31))
    s = np.asarray(sample, dtype=np.int64).astype(np.uint64)
    p = np.asarray(position, dtype=np.int64).astype(np.uint64)
    row = mix(mix(mix(np.full_like(s, np.uint64(seed))) ^ s) ^ p)
    d = mix(np.arange(draws, dtype=np.uint64) + np.uint64(1 << 40))
    z = mix(row[:, None] ^ d[None, :])
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def weights(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """int64 weights [n, V_local] of fp32 values u [n, V_local] against the global row max m [n]."""
    return (torch.exp(v - m[:, None]) * WEIGHT_SCALE).to(torch.int64)


def _chunk(x, draws, shard, group, temperature, u_draw, starts):
    """Draws of one chunk of this rank's logits [n, V_local] (ids [n, draws], non-finite flag)."""
    v = x[:, :shard.local_valid].float()
    if temperature != 1.0:
        v = v / float(temperature)
    n = v.shape[0]
    m = v.amax(dim=1) if v.shape[1] else v.new_full((n,), float("-inf"))
    bad = (~torch.isfinite(v)).any()
    m = all_reduce_max(m.contiguous(), group)
    w = weights(v, m) if v.shape[1] else v.new_zeros((n, 0), dtype=torch.int64)
    cum = w.cumsum(dim=1) if w.shape[1] else w.new_zeros((n, 1))
    total = cum[:, -1:] if w.shape[1] else w.new_zeros((n, 1))
    totals = _all_gather_cat(total.contiguous(), group)               # [n, tp], ranks in group order
    before = (totals * (starts < shard.start)).sum(dim=1)           # weight of the vocabulary before this shard
    t = (u_draw * totals.sum(dim=1, keepdim=True).double()).floor().to(torch.int64)
    t = torch.minimum(t, totals.sum(dim=1, keepdim=True) - 1) - before[:, None]
    mine = (t >= 0) & (t < total)
    local = torch.searchsorted(cum, t.clamp(min=0).contiguous(), right=True) if w.shape[1] else torch.zeros_like(t)
    ids = torch.where(mine, local + shard.start, torch.full_like(local, -1))
    return all_reduce_max(ids, group), bad


def distinct_counts(draws: torch.Tensor):
    """Draws [n, N] -> (ids [n, N], counts [n, N]): each row's distinct ids by count descending, ties by smaller id,
    then id -1 / count 0."""
    n, N = draws.shape
    s = draws.sort(dim=1).values
    first = torch.ones_like(s, dtype=torch.bool)
    first[:, 1:] = s[:, 1:] != s[:, :-1]
    group_of = first.long().cumsum(dim=1) - 1
    counts = torch.zeros_like(s).scatter_add_(1, group_of, torch.ones_like(s))
    ids = torch.full_like(s, -1).scatter_(1, group_of, s)
    big = 1 << 32
    key = torch.where(counts > 0, counts * big + (big - 1 - ids), torch.full_like(ids, -1))
    order = key.argsort(dim=1, descending=True, stable=True)
    return ids.gather(1, order), counts.gather(1, order)


def log_frequencies(counts: torch.Tensor, draws: int) -> torch.Tensor:
    """float32 log(count / N), -inf for count 0: the targets a sampled cache stores and its reader returns."""
    return torch.log(counts.double() / float(draws)).float()


class PendingSample:
    """N draws for each of n rows, queued on the device; result() waits (one host sync), raises on non-finite
    logits and returns (ids int64 [n, N], log-probs float32 [n, N]): the distinct ids drawn and log(count / N)."""

    @torch.no_grad()
    def __init__(self, n, logits_of, draws, shard, group, temperature, step, device, sample, position, seed):
        self.draws, self.group = draws, group
        sample = torch.as_tensor(sample, dtype=torch.int64).to(device)
        position = torch.as_tensor(position, dtype=torch.int64).to(device)
        if sample.shape != (n,) or position.shape != (n,):
            raise ValueError(f"sample and position must give one index per row ({n}), got {tuple(sample.shape)} and "
                             f"{tuple(position.shape)}")
        starts = _all_gather_cat(torch.tensor([[shard.start]], dtype=torch.int64, device=device), group)
        self.raw = torch.empty(n, draws, dtype=torch.int64, device=device)
        flags = []
        for a in range(0, n, step):
            b = min(n, a + step)
            u = uniforms(seed, sample[a:b], position[a:b], draws)
            self.raw[a:b], bad = _chunk(logits_of(a, b), draws, shard, group, temperature, u, starts)
            flags.append(bad)
        self.flag = torch.stack(flags).any().to(torch.int32) if flags else torch.zeros((), dtype=torch.int32,
                                                                                         device=device)

    @torch.no_grad()
    def result(self):
        if int(all_reduce_max(self.flag.reshape(1), self.group).item()):
            raise ValueError("teacher logits contain NaN or inf; check the teacher's dtype and weights")
        if (self.raw < 0).any():  # every row's draws land on some rank: a -1 left means the layout is inconsistent
            raise ValueError("a draw fell on no rank's vocabulary shard: the TP ranks' vocab_start_index values do not "
                             "tile the vocabulary")
        ids, counts = distinct_counts(self.raw)
        return ids, log_frequencies(counts, self.draws)

    def host_result(self):
        """(ids, log-probs, None): result()'s device tensors (the sink copies them), as PendingTopK.host_result
        gives them when no host copy was queued."""
        return (*self.result(), None)


def check_draws(draws) -> str | None:
    """None when draws suits a sampled cache, else what is wrong and the fix."""
    if isinstance(draws, bool) or not isinstance(draws, (int, np.integer)) or not 1 <= int(draws) <= MAX_DRAWS:
        return f"samples={draws!r} must be an integer in [1, {MAX_DRAWS}] (draws per position, e.g. 16)"
    return None


def _setup(local_rows, draws, group, vocab_start_index, temperature, valid_vocab_size):
    problem = temperature_problem(temperature)
    if problem:
        raise ValueError(f"temperature={temperature} {problem}")
    problem = check_draws(draws)
    if problem:
        raise ValueError(problem)
    shard = VocabShard.build(local_rows, group, vocab_start_index, valid_vocab_size)
    if shard.valid_size > _MAX_VOCAB:
        raise ValueError(f"sampling supports vocabularies up to {_MAX_VOCAB} ids (int64 weights), got "
                         f"{shard.valid_size}")
    return shard, int(draws)


def start_sample(logits_shard, draws, sample, position, group=None, vocab_start_index=None, temperature=1.0,
                 valid_vocab_size=None, chunk_size=None, seed: int = 0) -> PendingSample:
    """Draws from logits_shard [n, V_local]; sample / position [n]: each row's sample index and position."""
    n, rows, logits_of, step = logits_source(logits_shard, chunk_size)
    shard, draws = _setup(rows, draws, group, vocab_start_index, temperature, valid_vocab_size)
    return PendingSample(n, logits_of, draws, shard, group, temperature, step, logits_shard.device, sample, position,
                         seed)


def start_sample_from_hidden(hidden, weight_shard, draws, sample, position, group=None, chunk_size=None,
                             temperature=1.0, vocab_start_index=None, valid_vocab_size=None,
                             seed: int = 0) -> PendingSample:
    """start_sample of hidden [n, H] @ weight_shard[V_local, H].T, one [chunk, V_local] block at a time."""
    n, rows, logits_of, step = hidden_source(hidden, weight_shard, chunk_size)
    shard, draws = _setup(rows, draws, group, vocab_start_index, temperature, valid_vocab_size)
    return PendingSample(n, logits_of, draws, shard, group, temperature, step, hidden.device, sample, position, seed)


def vocab_parallel_sample(logits_shard, draws, sample, position, group=None, vocab_start_index=None,
                          temperature=1.0, valid_vocab_size=None, seed: int = 0):
    """(ids int64 [n, N], log(count / N) float32 [n, N]) of N draws per row, identical on every rank and layout."""
    n = logits_shard.shape[0] if logits_shard.dim() == 2 else 0
    return start_sample(logits_shard, draws, sample, position, group, vocab_start_index, temperature,
                        valid_vocab_size, chunk_size=max(1, n), seed=seed).result()


def expected_distinct(probs, draws: int) -> float:
    """E[distinct ids among N draws] = sum_v 1 - (1 - p_v)^N (what a sampled cache's size follows)."""
    p = np.asarray(probs, dtype=np.float64)
    return float(np.sum(-np.expm1(draws * np.log1p(-np.minimum(p, 1.0 - 1e-16)))))

