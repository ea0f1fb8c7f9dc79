"""Teacher top-K over a vocab-parallel output layer: only O(N x K x tp) values cross ranks.

Each rank takes its local top-K, all ranks all-gather those K x tp candidates, and every rank picks
the same global top-K. Log-probs are taken against the TP-global log-sum-exp (all-reduce MAX + SUM).

Ties are broken by the smaller global id, through one int64 key per candidate (value bits high, id low),
so the result does not depend on the TP layout or on torch.topk's tie order: a cache built at TP=1
and at TP=2 names the same ids whenever the two layouts produce the same logits.

The local top-K ranks the logits in their own dtype: torch.topk of K + slack candidates per row (a 16-bit radix
select on bf16 logits, against a 64-bit one over int64 keys of every logit), then the exact (value, id) keys of
those candidates only. The candidates hold every logit the exact rule could pick unless the row's K-th value ties
with its last candidate; such rows are rare, and their chunk is redone with keys over the whole row. Wide rows (a
201K-id vocabulary) take those K + slack candidates from the columns of the K + slack blocks of 64 ids with the
largest maxima (_block_topk): one read of the row for the block maxima replaces the radix select's passes over it,
and the candidates' values are the same. The
log-sum-exp reads the logits once (kernels.sumexp on CUDA). Chunks run without host syncs: the ties and
non-finite logits are flagged on the device and looked at once, after the last chunk, through a copy queued right
after it (PendingTopK), so looking waits for this top-K and nothing queued later.
"""
import torch
import torch.distributed as dist

from .comm import all_reduce_max, all_reduce_sum, group_size
from ..rules import temperature_problem, top_k_fits
from .limits import rows_per_chunk
from .vocab import VocabShard

_LOW = 1 << 32
_EMPTY = torch.iinfo(torch.int64).min  # key of a padding candidate (a shard with fewer than K valid ids)
# Columns per block of the wide-row prefilter (_block_topk): small enough that the kept blocks hold few columns
# (kk x 64 of a 201K-id row), large enough that the block maxima are a small array to rank.
BLOCK = 64


def candidates(k: int) -> int:
    """Candidates per row the local top-K takes before the exact key order: K plus room for ties at the K-th
    value (ties of more than the slack send the chunk to the whole-row keys)."""
    return k + max(16, k // 4)


def _ordered(u: torch.Tensor) -> torch.Tensor:
    bits = u.contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)


def _keys(u: torch.Tensor, start: int) -> torch.Tensor:
    """Order-preserving int64 keys of a whole row block: larger value first, then smaller global id."""
    ids = torch.arange(start, start + u.shape[1], device=u.device, dtype=torch.int64)
    return _ordered(u) * _LOW + (_LOW - 1 - ids)


def _keys_of(u: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The same keys for given fp32 values and their global ids."""
    return _ordered(u) * _LOW + (_LOW - 1 - ids)


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


def _pad(local: torch.Tensor, k: int) -> torch.Tensor:
    if local.shape[1] < k:
        local = torch.cat([local, local.new_full((local.shape[0], k - local.shape[1]), _EMPTY)], dim=1)
    return local


def _local_exact(v: torch.Tensor, k: int, start: int):
    """Keys over every logit of the row block (the reference rule): (local top-K keys, fp32 row max, no ties)."""
    u = v.float()
    n, width = u.shape
    local = _keys(u, start).topk(min(k, width), dim=1).values if width else u.new_empty((n, 0), dtype=torch.int64)
    m = u.amax(dim=1) if width else u.new_full((n,), float("-inf"))
    return _pad(local, k), m, torch.zeros(n, dtype=torch.bool, device=u.device)


def _blocks_pay(width: int, kk: int) -> bool:
    """Whether the block prefilter is worth it: the row must hold many more blocks than the kk it keeps (below,
    the block maxima and the gather cost about what the plain top-kk saves)."""
    return width >= 4 * kk * BLOCK


def _block_maxima(v: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[n, nb]: each full block's max. On CUDA one Triton pass over v (kernels/blockmax), the max taken in the order
    topk ranks floats by (a block holding both zeros gives +0.0, as topk would rank it; NaN rows raise later in any
    case); elsewhere torch's amax."""
    if v.is_cuda:
        try:
            from ..kernels.blockmax import block_max_rows
        except ImportError:  # no Triton: torch's reduction
            pass
        else:
            return block_max_rows(v, BLOCK)
    return blocks.amax(dim=2)


def _block_topk(v: torch.Tensor, kk: int):
    """The kk largest values of each row of v [n, W] (sorted, descending) and their columns, as v.topk(kk) gives
    them, through a prefilter: the row's full blocks of BLOCK columns are ranked by their max, and the top-kk runs
    only over the columns of the kk best blocks plus the last partial block (if W % BLOCK). Only ties at the kk-th
    value may come out in another order than v.topk's, which never changes a result (see _local_fast).

    Why nothing is lost. Let t be the row's kk-th largest value (with multiplicity), so fewer than kk of its values
    are > t. Every selected block's max is >= the max of every block left out (the block top-kk), in v's dtype,
    the order the final top-kk uses.
    (a) Every value x > t lies in the candidates: if x sat in a block left out, that block's max would be >= x > t,
        so each of the kk selected blocks would hold a max > t: with x, kk + 1 values > t. Contradiction.
    (b) The candidates hold at least kk values >= t: if some value equal to t lies in a block left out, each of the
        kk selected blocks has max >= t (kk distinct values); otherwise every value >= t of the row is a candidate.
    The candidates are a subset of the row, so their kk-th largest value is <= t, and by (b) it is >= t: it is t.
    With (a), their top-kk values are the row's top-kk values, one for one (equal values, possibly other columns
    among those equal to t): the K-th value, the kk-th value (the tie flag), the row max are those of v.topk(kk).
    NaN (ranked above everything by both amax and topk) and +-inf make the chunk raise (_sum_exp counts them)."""
    n, width = v.shape
    nb = width // BLOCK
    full = nb * BLOCK
    blocks = v[:, :full].unflatten(1, (nb, BLOCK))
    best = _block_maxima(v, blocks).topk(kk, dim=1, sorted=False).indices  # kk blocks, not K: (a) and (b) need kk
    cand = blocks.gather(1, best.unsqueeze(2).expand(n, kk, BLOCK)).flatten(1)  # [n, kk * BLOCK]
    if full < width:
        cand = torch.cat([cand, v[:, full:]], dim=1)
    vals, j = cand.topk(kk, dim=1)
    if full == width:  # j: column j % BLOCK of kept block j // BLOCK
        return vals, best.gather(1, j // BLOCK) * BLOCK + j % BLOCK
    picked = kk * BLOCK  # from there on, the partial block
    cols = torch.where(j < picked, best.gather(1, (j // BLOCK).clamp(max=kk - 1)) * BLOCK + j % BLOCK,
                       j - picked + full)
    return vals, cols


def _local_fast(v: torch.Tensor, k: int, start: int):
    """The same result from K + slack candidates ranked in v's dtype; the flag marks rows whose K-th value ties
    with their last candidate (the exact rule may pick a logit the candidates left out).

    Wide rows take their candidates through _block_topk: the same top-kk values, only the columns of values equal
    to the kk-th may differ from v.topk's. That changes nothing: a row is flagged exactly when its K-th value equals
    its kk-th (then the chunk is redone over the whole row); otherwise every logit the exact rule can pick is > the
    kk-th value, and both candidate sets hold all of those."""
    n, width = v.shape
    kk = min(width, candidates(k))
    if kk == 0:
        return _local_exact(v, k, start)
    vals, idx = _block_topk(v, kk) if _blocks_pay(width, kk) else v.topk(kk, dim=1)
    u = vals.float()
    kw = min(k, width)
    local = _keys_of(u, idx + start).topk(kw, dim=1).values
    tie = vals[:, kk - 1] == vals[:, kw - 1] if kk < width else torch.zeros(n, dtype=torch.bool, device=v.device)
    return _pad(local, k), u[:, 0].contiguous(), tie


def _sum_exp(v: torch.Tensor, m: torch.Tensor):
    """(sum_j exp(u_j - m) in fp64, count of non-finite u_j) per row, u = v in fp32."""
    if v.shape[1] == 0:
        return m.new_zeros(v.shape[0], dtype=torch.float64), torch.zeros(v.shape[0], dtype=torch.int32,
                                                                          device=v.device)
    if v.is_cuda:
        try:
            from ..kernels.sumexp import sum_exp_rows
        except ImportError:  # no Triton: the torch ops below
            pass
        else:
            return sum_exp_rows(v, m)
    u = v.float()
    # fp64 sum: the TP-split partial sums then round alike at any TP size.
    return torch.exp(u - m[:, None]).sum(dim=1, dtype=torch.float64), (~torch.isfinite(u)).sum(dim=1)


def _chunk(x, k, shard, group, temperature, exact):
    """Top-K of one chunk of this rank's logits [n, V_local]: (ids, log-probs, [ties, non-finite] flags)."""
    v = x[:, :shard.local_valid]
    if temperature != 1.0:
        v = v.float() / float(temperature)  # ranked as u itself: fp32 division can merge neighbouring values
    local, m, tie = (_local_exact if exact else _local_fast)(v, k, shard.start)
    # local is sorted (a top-K's values, then padding keys at the minimum): alone, it is its own top-K
    best = local if group_size(group) == 1 else _all_gather_cat(local, group).topk(k, dim=1).values
    ids, vals = _decode_keys(best)
    m = all_reduce_max(m.contiguous(), group)
    s, bad = _sum_exp(v, m)
    s = all_reduce_sum(s, group)
    lse = m.double() + torch.log(s)
    flags = torch.stack([tie.any(), (bad > 0).any()]).to(torch.int32)
    return ids, (vals.double() - lse[:, None]).float(), flags


class PendingTopK:
    """The top-K of N rows, queued on the device; result() waits for it, raises on non-finite logits, and redoes
    with whole-row keys the chunks whose ties the candidates could not settle.

    On CUDA the flags leave the device as they are queued (pinned memory, an event after them), so result() waits
    for this top-K only, never for work queued after it (the next micro-batch's forward): a builder queues that
    forward first and takes this result while the device runs it. copy_to_host() queues the result's copy the
    same way (on a side stream) and host_result() hands out the host copies."""

    @torch.no_grad()
    def __init__(self, n, logits_of, k, shard, group, temperature, step, device):
        self.n, self.logits_of, self.k, self.shard = n, logits_of, k, shard
        self.group, self.temperature, self.step = group, temperature, step
        self.ids = torch.empty(n, k, dtype=torch.int64, device=device)
        self.logp = torch.empty(n, k, dtype=torch.float32, device=device)
        flags = []
        for a in range(0, n, step):
            i, lp, f = _chunk(logits_of(a, min(n, a + step)), k, shard, group, temperature, exact=False)
            self.ids[a:a + step], self.logp[a:a + step] = i, lp
            flags.append(f)
        flags = torch.stack(flags) if flags else torch.zeros(0, 2, dtype=torch.int32, device=device)
        self.flags = all_reduce_max(flags, group)  # every rank takes the same decisions
        self._flags_host = self._flags_ready = self._host = None
        self._redone = False
        self._stream = torch.cuda.current_stream(self.flags.device) if self.flags.is_cuda else None
        if self.flags.is_cuda:
            self._flags_host = torch.empty(self.flags.shape, dtype=self.flags.dtype, pin_memory=True)
            self._flags_host.copy_(self.flags, non_blocking=True)
            self._flags_ready = torch.cuda.Event()
            self._flags_ready.record(torch.cuda.current_stream(self.flags.device))  # the flags' device

    @torch.no_grad()
    def copy_to_host(self) -> "PendingTopK":
        """Queue the copy of ids (as int32: ids < 2**31) and log-probs into pinned host memory on a side stream,
        after this top-K (on the stream it was queued on) and before anything queued later; no-op off CUDA."""
        if not self.ids.is_cuda or self._host is not None:
            return self
        with torch.cuda.stream(self._stream):  # the stream the top-K was queued on, wherever this is called from
            ids = self.ids.to(torch.int32)
        stream = _copy_stream(self.ids.device)
        stream.wait_stream(self._stream)
        host = []
        with torch.cuda.stream(stream):
            for t in (ids, self.logp):
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t.record_stream(stream)  # the device tensor lives until the copy has read it
                host.append(h)
        ready = torch.cuda.Event()
        ready.record(stream)
        self._host = (host[0], host[1], ready)
        return self

    def _settle(self) -> None:
        """Check the flags (waiting for this top-K only) and redo the tied chunks."""
        if self._flags_ready is not None:
            self._flags_ready.synchronize()
            flags = self._flags_host.tolist()
        else:
            flags = self.flags.tolist()
        if any(f[1] for f in flags):
            raise ValueError("teacher logits contain NaN or inf; check the teacher's dtype and weights")
        for c, (tie, _) in enumerate(flags):
            if tie:
                if self._host is not None:  # the copy reads self.logp: its writes below must come after
                    torch.cuda.current_stream(self.ids.device).wait_event(self._host[2])
                a = c * self.step
                b = min(self.n, a + self.step)
                i, lp, _ = _chunk(self.logits_of(a, b), self.k, self.shard, self.group, self.temperature, exact=True)
                self.ids[a:b], self.logp[a:b] = i, lp
                self._redone = True
        self.logits_of = None  # drop the references to the hidden states / logits

    @torch.no_grad()
    def result(self):
        """(ids int64 [N, K], log-probs float32 [N, K]) on the device of the logits."""
        if self.logits_of is not None:
            self._settle()
        return self.ids, self.logp

    @torch.no_grad()
    def host_result(self):
        """(ids, log-probs, ready): after copy_to_host(), the pinned host copies (int32 ids) and the CUDA event
        after which they are complete; else (or when a chunk was redone, the copy being stale) result()'s tensors
        and None."""
        if self.logits_of is not None:
            self._settle()
        if self._host is None or self._redone:
            return self.ids, self.logp, None
        return self._host


_COPY_STREAMS = {}


def _copy_stream(device):
    """One side stream per device for the results' device-to-host copies."""
    d = torch.device(device)
    key = d.index if d.index is not None else torch.cuda.current_device()
    if key not in _COPY_STREAMS:
        _COPY_STREAMS[key] = torch.cuda.Stream(device=key)
    return _COPY_STREAMS[key]


def _shard_and_k(local_rows, k, group, vocab_start_index, temperature, valid_vocab_size, shard=None):
    problem = temperature_problem(temperature)
    if problem:
        raise ValueError(f"temperature={temperature} {problem}")
    if (shard is None or shard.size != local_rows or shard.group is not group
            or (vocab_start_index is not None and shard.start != int(vocab_start_index))
            or (valid_vocab_size is not None and shard.valid_size != int(valid_vocab_size))):
        shard = VocabShard.build(local_rows, group, vocab_start_index, valid_vocab_size)
    k = int(k)
    if not top_k_fits(k, shard.valid_size):
        raise ValueError(f"k={k} must be in [1, {shard.valid_size}] (the valid vocabulary size)")
    return shard, k


def logits_source(logits_shard, chunk_size=None):
    """(rows, vocab rows of the shard, logits_of(a, b), rows per chunk) of a logits shard [N, V_local]."""
    if logits_shard.dim() != 2:
        raise ValueError(f"logits_shard must be [N, V_local], got shape {tuple(logits_shard.shape)}")
    step = max(1, int(chunk_size or rows_per_chunk(logits_shard.shape[1])))
    return logits_shard.shape[0], logits_shard.shape[1], lambda a, b: logits_shard[a:b], step


def hidden_source(hidden, weight_shard, chunk_size=None):
    """The same for hidden [N, H] @ weight_shard[V_local, H].T: one [chunk, V_local] block exists at a time."""
    if hidden.dim() != 2 or weight_shard.dim() != 2 or hidden.shape[1] != weight_shard.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight_shard [V_local, H]; got {tuple(hidden.shape)} and "
                         f"{tuple(weight_shard.shape)} (pass the output layer's weight, not its transpose)")
    step = max(1, int(chunk_size or rows_per_chunk(weight_shard.shape[0])))
    w = weight_shard.to(hidden.dtype)
    return hidden.shape[0], weight_shard.shape[0], lambda a, b: hidden[a:b] @ w.t(), step


def start_topk(logits_shard, k, group=None, vocab_start_index=None, temperature=1.0, valid_vocab_size=None,
               chunk_size=None, *, shard=None) -> PendingTopK:
    """vocab_parallel_topk, queued: logits_shard [N, V_local], chunk_size rows at a time.
    shard: the .shard of an earlier PendingTopK of the same layout (same group, vocab_start_index and
    valid_vocab_size): reused, it saves the collective that sizes an uneven layout's vocabulary (a host sync)."""
    n, rows, logits_of, step = logits_source(logits_shard, chunk_size)
    shard, k = _shard_and_k(rows, k, group, vocab_start_index, temperature, valid_vocab_size, shard)
    return PendingTopK(n, logits_of, k, shard, group, temperature, step, logits_shard.device)


def start_topk_from_hidden(hidden, weight_shard, k, group=None, chunk_size=None, temperature=1.0,
                           vocab_start_index=None, valid_vocab_size=None, *, shard=None) -> PendingTopK:
    """topk_from_hidden, queued (see PendingTopK; shard as in start_topk)."""
    n, rows, logits_of, step = hidden_source(hidden, weight_shard, chunk_size)
    shard, k = _shard_and_k(rows, k, group, vocab_start_index, temperature, valid_vocab_size, shard)
    return PendingTopK(n, logits_of, k, shard, group, temperature, step, hidden.device)


def vocab_parallel_topk(logits_shard, k, group=None, vocab_start_index=None, temperature=1.0,
                        valid_vocab_size=None):
    """Global top-K of softmax(logits / temperature) from this rank's vocab shard [N, V_local].

    Returns (ids int64 [N, K] global ids, logprobs float32 [N, K]), identical on every rank, sorted by
    log-prob descending (ties: smaller id first). Ids at or above valid_vocab_size (padding) never appear.
    """
    n = logits_shard.shape[0] if logits_shard.dim() == 2 else 0
    return start_topk(logits_shard, k, group, vocab_start_index, temperature, valid_vocab_size,
                      chunk_size=max(1, n)).result()


def topk_from_hidden(hidden, weight_shard, k, group=None, chunk_size=None, temperature=1.0,
                     vocab_start_index=None, valid_vocab_size=None):
    """vocab_parallel_topk of hidden [N, H] @ weight_shard[V_local, H].T, chunk_size rows at a time.

    Only one [chunk, V_local] logit block exists at a time. Every rank of the group must pass the same N.
    """
    return start_topk_from_hidden(hidden, weight_shard, k, group, chunk_size, temperature, vocab_start_index,
                                  valid_vocab_size).result()
