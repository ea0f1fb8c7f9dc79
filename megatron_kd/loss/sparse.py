"""The O(N x K) side of the fused loss, in torch: slot bookkeeping, per-row statistics from the
kernel's partial sums, and gradient coefficients taken from loss.core (never a second copy of the math).

Slots: the K teacher ids plus, with CE, the label (K1 = K + 1 columns per row). The row kernel masks
the slot columns of the logits, so the sums it returns cover the other columns; each distinct owned
slot column is added back exactly once here ("first" slots), which also makes duplicate ids exact.
"""
from dataclasses import dataclass, replace

import torch

from .core import ChunkStats, chunk_grad, local_columns, unpack_stats
from .inputs import Targets
from .options import LossOptions
from ..parallel.comm import all_reduce_max, all_reduce_sum
from ..parallel.vocab import VocabShard


@dataclass
class Slots:
    idx: torch.Tensor    # [N, K1] int32 local column, -1 where the slot is not on this shard (kernel input)
    col: torch.Tensor    # [N, K1] int64 local column, 0 where not owned (safe for scatter/gather)
    own: torch.Tensor    # [N, K1] bool
    first: torch.Tensor | None  # [N, K1] bool: owned and the first slot naming its column (None: not computed)
    cid: torch.Tensor | None    # [N, K1] int64 compact column (first slot of the same column; JUNK if not owned)
    k: int
    k1: int

    def rows(self, a, b):
        f = lambda x: None if x is None else x[a:b]  # noqa: E731
        return Slots(self.idx[a:b], self.col[a:b], self.own[a:b], f(self.first), f(self.cid), self.k, self.k1)


def _first_slot(key: torch.Tensor) -> torch.Tensor:
    """For every slot, the smallest slot index of its row with the same key."""
    n, k1 = key.shape
    sk, order = torch.sort(key, dim=1, stable=True)
    pos = torch.arange(k1, device=key.device).expand(n, k1)
    start = torch.ones_like(sk, dtype=torch.bool)
    start[:, 1:] = sk[:, 1:] != sk[:, :-1]
    seg = torch.where(start, pos, torch.zeros_like(pos)).cummax(dim=1).values
    return torch.empty_like(order).scatter_(1, order, order.gather(1, seg))


def prepare_slots(t: Targets, opts: LossOptions, shard: VocabShard, dedupe: bool = True) -> Slots:
    """dedupe=False leaves first / cid None (kernels.scaled finds duplicates itself; the sort costs launches)."""
    ids, ok = t.ids, t.valid
    if opts.needs_ce:
        ids = torch.cat([ids, t.labels[:, None]], 1)
        ok = torch.cat([ok, (t.labels >= 0)[:, None]], 1)
    n, k1 = ids.shape
    own, col = local_columns(ids, ok, shard)
    idx = torch.where(own, col, -1).to(torch.int32).contiguous()
    if not dedupe:
        return Slots(idx, col, own, None, None, t.ids.shape[1], k1)
    ar = torch.arange(k1, device=ids.device).expand(n, k1)
    first = _first_slot(torch.where(own, col, -1 - ar)) if k1 else ar  # non-owned keys stay unique
    is_first = own & (first == ar)
    cid = torch.where(own, first, torch.full_like(first, k1))  # k1 = the junk column
    return Slots(idx, col, own, is_first, cid, t.ids.shape[1], k1)


def combine_stats(zg, stat, sl: Slots, opts: LossOptions, shard: VocabShard) -> ChunkStats:
    """Global ChunkStats (as core.chunk_stats would return) from this shard's kernel outputs.
    Two collectives, as in core: a MAX of [C] and one SUM of [C, K + up to 3]."""
    T = opts.temperature
    a, se, s1 = stat[:, 0], stat[:, 1], stat[:, 2]
    u = zg / T if T != 1.0 else zg
    m = all_reduce_max(a.clone(), shard.group)  # a >= every slot logit, so m bounds all exponents below
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    zero = torch.zeros((), dtype=zg.dtype, device=zg.device)
    e_slot = torch.where(sl.first, torch.exp(u - m[:, None]), zero)
    base = se * torch.exp(a - m)
    cols = [base + e_slot.sum(1)]
    if opts.needs_rest:  # the rest: every column but the teacher's ids (the label's column counts)
        cols.append(base + (e_slot[:, sl.k] if opts.needs_ce else 0.0))
    if opts.needs_ce:
        if T != 1.0:
            e1 = torch.where(sl.first, torch.exp(zg - (m * T)[:, None]), zero)
            cols.append(s1 * torch.exp((a - m) * T) + e1.sum(1))
        cols.append(torch.where(sl.own[:, sl.k], zg[:, sl.k], zero))
    uk = torch.where(sl.own[:, :sl.k], u[:, :sl.k], zero)
    packed = all_reduce_sum(torch.cat([torch.stack(cols, 1), uk], 1), shard.group)
    return unpack_stats(packed, m, len(cols), opts)


def _compact_grad(zg, probe, st, t: Targets, sl: Slots, opts: LossOptions, g):
    """core.chunk_grad on a compact logit block: the slot columns, a junk column (slots owned elsewhere)
    and a probe column whose softmax factor is 1, which reads off the dense coefficient of the row."""
    c = zg.shape[0]
    ninf = torch.full((c, 1), float("-inf"), dtype=zg.dtype, device=zg.device)
    z = torch.cat([torch.where(sl.own, zg, ninf), ninf, probe[:, None]], 1)
    width = sl.k1 + 2
    lab = None
    if opts.needs_ce:
        lab = torch.where(t.labels >= 0, sl.cid[:, sl.k], torch.full_like(t.labels, -1))
    tc = Targets(sl.cid[:, :sl.k], t.logp, t.valid, lab, t.weight)
    dz = chunk_grad(z, st, tc, opts, VocabShard(0, width, width, width), g)
    vals = torch.where(sl.first, dz[:, :sl.k1], torch.zeros((), dtype=dz.dtype, device=dz.device))
    return vals, dz[:, width - 1]


def grad_coefficients(zg, st: ChunkStats, t: Targets, sl: Slots, opts: LossOptions, g):
    """Per row: vals [C, K1] = the finished logit gradient at each first owned slot column (0 elsewhere),
    A, B with dz = A exp(u - lse) + B exp(z - lse1) on every other column (B is None unless CE at T != 1)."""
    T = opts.temperature
    if not opts.ce_untempered:
        vals, A = _compact_grad(zg, st.lse * T, st, t, sl, opts, g)
        return vals, A, None
    # Two exponentials: split KL (temperature T) and CE (temperature 1), each read off core separately.
    vals, A = _compact_grad(zg, st.lse * T, st, t, sl, replace(opts, ce_weight=0.0), g)
    st1 = ChunkStats(lse=st.lse1, uk=st.uk, lse1=st.lse1, zy=st.zy)
    vals1, B = _compact_grad(zg, st.lse1, st1, t, sl, replace(opts, kl_weight=0.0, temperature=1.0), g)
    return vals + vals1, A, B
