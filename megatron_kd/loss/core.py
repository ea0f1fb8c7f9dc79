"""The one numerical core every impl shares: per-chunk statistics, per-position loss, logit gradient.

Notation: z = student logits of this rank's vocab shard [C, Vs]; u = z / T; lse = logsumexp(u) over
the whole (global) vocabulary; q = softmax(u). Only O(C x K) values cross ranks (see chunk_stats).
"""
import math
from dataclasses import dataclass

import torch

from ..parallel.comm import all_reduce_max, all_reduce_sum
from ..parallel.vocab import VocabShard
from .inputs import Targets
from .options import LossOptions


@dataclass
class ChunkStats:
    lse: torch.Tensor                 # [C] logsumexp(u) over the global vocabulary
    uk: torch.Tensor                  # [C, K] u at the teacher ids (0 in empty slots)
    lse1: torch.Tensor | None = None  # [C] logsumexp(z) (T = 1) for the CE term
    zy: torch.Tensor | None = None    # [C] z at the label
    rest_lse: torch.Tensor | None = None  # [C] logsumexp(u) over ids not among the top-K (bucket tail)

    def select(self, a, b):
        f = lambda t: None if t is None else t[a:b]  # noqa: E731
        return ChunkStats(f(self.lse), f(self.uk), f(self.lse1), f(self.zy), f(self.rest_lse))

    def put(self, rows, other: "ChunkStats") -> "ChunkStats":
        """A copy with the given rows replaced by other's."""
        f = lambda a, b: None if a is None else a.index_put((rows,), b)  # noqa: E731
        return ChunkStats(f(self.lse, other.lse), f(self.uk, other.uk), f(self.lse1, other.lse1),
                          f(self.zy, other.zy), f(self.rest_lse, other.rest_lse))

    @staticmethod
    def cat(parts):
        f = lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        return ChunkStats(f("lse"), f("uk"), f("lse1"), f("zy"), f("rest_lse"))


def local_columns(ids: torch.Tensor, ok: torch.Tensor, shard: VocabShard):
    """(owned mask, local column index) of global ids in this shard's softmax columns."""
    width = shard.local_valid
    own = ok & (ids >= shard.start) & (ids < shard.start + width)
    idx = torch.where(own, ids - shard.start, torch.zeros_like(ids))
    return own, idx


def _gather(x: torch.Tensor, idx: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 0:
        return torch.zeros(idx.shape, dtype=x.dtype, device=x.device)
    return torch.where(own, x.gather(1, idx), torch.zeros((), dtype=x.dtype, device=x.device))


def chunk_stats(z: torch.Tensor, t: Targets, opts: LossOptions, shard: VocabShard) -> ChunkStats:
    """Two collectives per chunk: a MAX of [C] and one SUM of [C, K + up to 3]."""
    T = opts.temperature
    u = z if T == 1.0 else z / T
    c = z.shape[0]
    neg_inf = torch.full((c,), float("-inf"), dtype=z.dtype, device=z.device)
    m = u.amax(dim=1) if z.shape[1] else neg_inf
    m = all_reduce_max(m.contiguous(), shard.group)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rank-local shards may be empty
    e = torch.exp(u - m[:, None])
    cols = [e.sum(dim=1)]
    own, idx = local_columns(t.ids, t.valid, shard)
    if opts.needs_rest:
        hit = torch.zeros_like(e).scatter_add_(1, idx, own.to(e.dtype)) if z.shape[1] else e
        cols.append(e.masked_fill(hit > 0, 0.0).sum(dim=1))  # exact: no 1 - sum(q) cancellation
    del e
    if opts.needs_ce:
        if T != 1.0:
            cols.append(torch.exp(z - (m * T)[:, None]).sum(dim=1))
        lab_own, lab_idx = local_columns(t.labels[:, None], t.labels[:, None] >= 0, shard)
        cols.append(_gather(z, lab_idx, lab_own)[:, 0])
    packed = torch.cat([torch.stack(cols, dim=1), _gather(u, idx, own)], dim=1)
    return unpack_stats(all_reduce_sum(packed, shard.group), m, len(cols), opts)


def unpack_stats(packed: torch.Tensor, m: torch.Tensor, n_cols: int, opts: LossOptions) -> ChunkStats:
    """packed [C, n_cols + K] after the SUM: sum-exp columns (total, [rest], [T=1 total], [z at label]), then u at
    the K ids; m is the global max of u. Shared with the fused kernels, which fill the same layout."""
    T = opts.temperature
    st = ChunkStats(lse=m + torch.log(packed[:, 0]), uk=packed[:, n_cols:])
    j = 1
    if opts.needs_rest:
        st.rest_lse = m + torch.log(packed[:, j])
        j += 1
    if opts.needs_ce:
        if T != 1.0:
            st.lse1 = m * T + torch.log(packed[:, j])
            j += 1
        else:
            st.lse1 = st.lse
        st.zy = packed[:, j]
    return st


def _teacher(t: Targets):
    p = torch.exp(t.logp) * t.valid
    return p, p.sum(dim=1)


def _rest_mass(P: torch.Tensor) -> torch.Tensor:
    """Teacher mass outside its top-K; below the rounding of a K-term sum it is zero (K == V, for one), so the
    rest bucket cannot turn rounding noise into log(0) = -inf."""
    R = (1.0 - P).clamp_min(0.0)
    return torch.where(R > 64 * torch.finfo(R.dtype).eps, R, torch.zeros_like(R))


def _log_S(st: ChunkStats, t: Targets):
    """log of the student's mass on the teacher's ids."""
    return torch.logsumexp(st.uk.masked_fill(~t.valid, float("-inf")), dim=1) - st.lse


def forward_kl(st: ChunkStats, t: Targets, tail: str) -> torch.Tensor:
    """Per-position KL(teacher || student) [C] on the teacher's ids, with the given tail (unweighted, no T^2)."""
    p, P = _teacher(t)
    if tail == "renormalize":
        logP = torch.log(P)
        lqt = st.uk - torch.logsumexp(st.uk.masked_fill(~t.valid, float("-inf")), dim=1, keepdim=True)
        kl = (p * (t.logp - logP[:, None] - lqt)).masked_fill(~t.valid, 0.0).sum(dim=1) / P
        return torch.where(P > 0, kl, torch.zeros_like(kl))
    lq = st.uk - st.lse[:, None]
    kl = (p * (t.logp - lq)).masked_fill(~t.valid, 0.0).sum(dim=1)
    if tail == "bucket":
        R = _rest_mass(P)
        log_r = st.rest_lse - st.lse
        rest = R * (torch.log(R) - log_r)
        kl = kl + torch.where(R > 0, rest, torch.zeros_like(rest))
    return kl


# Reverse KL on the bucket tail needs log R of the teacher's rest class; a cache whose top-K holds all the mass
# (R below rounding) would make it log 0. The rest class's teacher mass is floored at this value inside that log
# only (docs/loss.md). At K = V the student's rest mass is exactly 0, so the floor never acts there.
REVERSE_REST_FLOOR = 1e-6


def _classes(st: ChunkStats, t: Targets, tail: str):
    """The classes a divergence compares, per row: teacher and student log-probs at the K slots (lp, lq, both
    renormalized over the slots for tail "renormalize"), the slot mask, and for tail "bucket" the rest class
    (lp_r, lq_r) [C] (teacher mass R = 1 - P, student mass r = its mass off the teacher's ids)."""
    ok = t.valid
    ninf = torch.full_like(st.uk, float("-inf"))
    if tail == "renormalize":
        p, P = _teacher(t)
        lp = torch.where(ok, t.logp - torch.log(P)[:, None], ninf)
        lq = st.uk - torch.logsumexp(st.uk.masked_fill(~ok, float("-inf")), dim=1, keepdim=True)
        ok = ok & (P > 0)[:, None]
        return lp, torch.where(ok, lq, ninf), ok, None
    lp = torch.where(ok, t.logp, ninf)
    lq = torch.where(ok, st.uk - st.lse[:, None], ninf)
    if tail != "bucket":
        return lp, lq, ok, None
    _, P = _teacher(t)
    return lp, lq, ok, (torch.log(_rest_mass(P)), st.rest_lse - st.lse)


def _terms(lp, lq, divergence: str, beta: float, rest: bool = False):
    """Elementwise f(p, q) (the divergence is the sum of f over classes) and G = df/dq (0 where q = 0, where
    only q G, which then vanishes, is ever used). reverse: f = q log(q / p); jsd: f = beta p log(p / m) +
    (1 - beta) q log(q / m) with m = beta p + (1 - beta) q. rest: the bucket's rest class (reverse KL floors p)."""
    q = torch.exp(lq)
    qpos = q > 0
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    if divergence == "reverse_kl":
        if rest:
            lp = torch.clamp_min(lp, math.log(REVERSE_REST_FLOOR))
        d = torch.where(qpos, lq - lp, zero)
        return torch.where(qpos, q * d, zero), torch.where(qpos, d + 1.0, zero)
    lm = torch.logaddexp(lp + math.log(beta), lq + math.log1p(-beta))
    p = torch.exp(lp)
    dq = torch.where(qpos, lq - lm, zero)
    f = torch.where(p > 0, beta * p * (lp - lm), zero) + (1.0 - beta) * q * dq
    return f, (1.0 - beta) * dq


def divergence_per_row(st: ChunkStats, t: Targets, opts: LossOptions) -> torch.Tensor:
    """Per-position divergence [C] between the sparse teacher and the student (unweighted, no T^2)."""
    if opts.divergence == "forward_kl":
        return forward_kl(st, t, opts.tail)
    lp, lq, ok, rest = _classes(st, t, opts.tail)
    f, _ = _terms(lp, lq, opts.divergence, opts.jsd_beta)
    d = f.masked_fill(~ok, 0.0).sum(dim=1)
    if rest is not None:
        d = d + _terms(rest[0], rest[1], opts.divergence, opts.jsd_beta, rest=True)[0]
    return d


def _divergence_grad(st: ChunkStats, t: Targets, opts: LossOptions):
    """(dense [C], sparse [C, K]) with d divergence / du = dense * q (every column) + sparse (at the slots).
    With class probabilities q_c and G_c = df/dq_c: d/du_j = q_j G_j [j a slot] + q_j G_rest [j off the slots]
    - q_j sum_c q_c G_c (renormalize: over the slots only, q renormalized)."""
    lp, lq, ok, rest = _classes(st, t, opts.tail)
    _, G = _terms(lp, lq, opts.divergence, opts.jsd_beta)
    G = G.masked_fill(~ok, 0.0)
    q = torch.exp(lq)  # 0 at empty slots (lq = -inf)
    H = q * G
    Hsum = H.sum(dim=1)
    if opts.tail == "renormalize":
        return torch.zeros_like(Hsum), H - q * Hsum[:, None]
    if rest is None:
        return -Hsum, H
    _, Gr = _terms(rest[0], rest[1], opts.divergence, opts.jsd_beta, rest=True)
    r = torch.exp(rest[1])
    return Gr - (Hsum + r * Gr), H - q * Gr[:, None]


def chunk_loss(st: ChunkStats, t: Targets, opts: LossOptions) -> torch.Tensor:
    """Per-position loss [C] (unweighted)."""
    loss = torch.zeros_like(st.lse)
    if opts.needs_kl:
        loss = loss + opts.kl_scale * divergence_per_row(st, t, opts)
    if opts.needs_ce:
        loss = loss + opts.ce_weight * (st.lse1 - st.zy)
    return loss


def chunk_monitor(st: ChunkStats, t: Targets) -> torch.Tensor:
    """Per-position bucket-tail KL(teacher || student) [C] at the training temperature: a true, non-negative
    divergence to watch beside the training loss (which, with tail "none", can go below 0)."""
    return forward_kl(st, t, "bucket")


def chunk_grad(z: torch.Tensor, st: ChunkStats, t: Targets, opts: LossOptions, shard: VocabShard,
               g: torch.Tensor) -> torch.Tensor:
    """d(sum_i g_i loss_i)/dz for this chunk, written over z (z is consumed)."""
    T = opts.temperature
    dense = torch.zeros_like(st.lse)      # per-row coefficient of q
    sparse = torch.zeros_like(st.uk)      # per-slot values added at the teacher ids
    a = T * opts.kl_weight * g            # dz = T^2 kw dKL/du * (1/T)
    if opts.needs_kl and opts.divergence != "forward_kl":
        dc, sp = _divergence_grad(st, t, opts)
        dense = dense + a * dc
        sparse = sparse + a[:, None] * sp
    elif opts.needs_kl:
        p, P = _teacher(t)
        if opts.tail == "none":
            dense = dense + a * P
            sparse = sparse - a[:, None] * p
        elif opts.tail == "renormalize":
            qt = torch.softmax(st.uk.masked_fill(~t.valid, float("-inf")), dim=1).nan_to_num(0.0)
            pt = torch.where(P[:, None] > 0, p / P[:, None], torch.zeros_like(p))
            sparse = sparse + a[:, None] * torch.where((P > 0)[:, None], qt - pt, torch.zeros_like(p))
        else:  # bucket: rest bucket couples every column through r = 1 - S
            R = _rest_mass(P)
            ratio = torch.exp(_log_S(st, t) - (st.rest_lse - st.lse))  # S / r
            c = P - torch.where(R > 0, R * ratio, torch.zeros_like(R))
            qk = torch.exp(st.uk - st.lse[:, None]) * t.valid
            dense = dense + a * c
            sparse = sparse + a[:, None] * (qk * (P + R - c)[:, None] - p)
    sm1 = None
    if opts.needs_ce:
        if T == 1.0:
            dense = dense + opts.ce_weight * g
        else:
            sm1 = torch.exp(z - st.lse1[:, None])
    if T != 1.0:
        z.div_(T)
    q = z.sub_(st.lse[:, None]).exp_()
    dz = q.mul_(dense[:, None])
    if sm1 is not None:
        dz.add_(sm1.mul_((opts.ce_weight * g)[:, None]))
    if dz.shape[1]:
        own, idx = local_columns(t.ids, t.valid, shard)
        dz.scatter_add_(1, idx, torch.where(own, sparse, torch.zeros_like(sparse)))
        if opts.needs_ce:
            lab_own, lab_idx = local_columns(t.labels[:, None], t.labels[:, None] >= 0, shard)
            dz.scatter_add_(1, lab_idx, torch.where(lab_own, (-opts.ce_weight * g)[:, None], torch.zeros_like(g)[:, None]))
    return dz
