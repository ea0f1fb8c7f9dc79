"""Triton kernels for the O(C x V) elementwise work over a chunk's logit rows (one program per row).

row_sweep: gathers the logits at the row's K+1 slot columns (teacher ids, label), masks those columns
    with -inf (so every sum below is over the *other* columns and the bucket tail's rest mass comes
    without 1 - sum(q) cancellation), then sums exp(u - a) (and exp(z - aT) for CE at T != 1) relative
    to a per-row anchor a, optionally writing E = exp(u - a) in the output dtype in the same sweep.
    The anchor is max(u at the slots, u over the first tile); if the row's max beats it by more than
    `slack`, the row is swept again with a = max (rare: keeps E and the sums far from overflow).
row_grad: the second sweep of the two-pass path: dz = A exp(u - lse) + B exp(z - lse1), written
    in the output dtype (masked slot columns give 0; their values are added afterwards).
"""
import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096


@triton.jit
def _sweep(z_row, e_row, V, a, at, inv_t, BLOCK: tl.constexpr, WRITE_E: tl.constexpr,
           NEED_S1: tl.constexpr, ACC: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mx = tl.full([BLOCK], float("-inf"), ACC)
    s = tl.zeros([BLOCK], ACC)
    s1 = tl.zeros([BLOCK], ACC)
    for start in range(0, V, BLOCK):
        cols = start + offs
        m = cols < V
        x = tl.load(z_row + cols, mask=m, other=float("-inf")).to(ACC)
        u = x * inv_t
        mx = tl.maximum(mx, u)
        ex = tl.exp(u - a)
        s += ex
        if NEED_S1:
            s1 += tl.exp(x - at)
        if WRITE_E:
            tl.store(e_row + cols, ex.to(e_row.dtype.element_ty), mask=m)
    return tl.max(mx, 0), tl.sum(s, 0), tl.sum(s1, 0)


@triton.jit
def _row_sweep_kernel(z_ptr, z_stride, e_ptr, e_stride, idx_ptr, zg_ptr, stat_ptr, V, K1,
                      inv_t, t, slack, BLOCK: tl.constexpr, KP: tl.constexpr, WRITE_E: tl.constexpr,
                      NEED_S1: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    e_row = e_ptr + row * e_stride
    ks = tl.arange(0, KP)
    kin = ks < K1
    idx = tl.load(idx_ptr + row * K1 + ks, mask=kin, other=-1)
    own = idx >= 0
    zk = tl.load(z_row + idx, mask=own, other=float("-inf"))
    tl.store(zg_ptr + row * K1 + ks, zk, mask=kin)
    tl.debug_barrier()  # every gather lands before any slot column is overwritten (duplicate ids)
    tl.store(z_row + idx, tl.full([KP], float("-inf"), zk.dtype), mask=own)
    tl.debug_barrier()
    offs = tl.arange(0, BLOCK)
    x0 = tl.load(z_row + offs, mask=offs < V, other=float("-inf")).to(ACC) * inv_t
    a = tl.maximum(tl.max(zk.to(ACC), 0) * inv_t, tl.max(x0, 0))
    a = tl.where(a == float("-inf"), 0.0, a)
    mx, s, s1 = _sweep(z_row, e_row, V, a, a * t, inv_t, BLOCK, WRITE_E, NEED_S1, ACC)
    if mx > a + slack:
        a = mx
        mx, s, s1 = _sweep(z_row, e_row, V, a, a * t, inv_t, BLOCK, WRITE_E, NEED_S1, ACC)
    tl.store(stat_ptr + row * 3, a)
    tl.store(stat_ptr + row * 3 + 1, s)
    tl.store(stat_ptr + row * 3 + 2, s1)


@triton.jit
def _row_grad_kernel(z_ptr, z_stride, d_ptr, d_stride, coef_ptr, V, inv_t, BLOCK: tl.constexpr,
                     NEED_B: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    A = tl.load(coef_ptr + row * 4).to(ACC)
    lse = tl.load(coef_ptr + row * 4 + 1).to(ACC)
    B = tl.load(coef_ptr + row * 4 + 2).to(ACC)
    lse1 = tl.load(coef_ptr + row * 4 + 3).to(ACC)
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + offs
        m = cols < V
        x = tl.load(z_ptr + row * z_stride + cols, mask=m, other=float("-inf")).to(ACC)
        d = A * tl.exp(x * inv_t - lse)
        if NEED_B:
            d += B * tl.exp(x - lse1)
        tl.store(d_ptr + row * d_stride + cols, d.to(d_ptr.dtype.element_ty), mask=m)


def _acc(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _block(v: int, block: int | None) -> int:
    return block or min(MAX_BLOCK, max(16, triton.next_power_of_2(v)))


def row_sweep(z, e, idx, temperature: float, need_s1: bool, slack: float, block: int | None = None):
    """z [C, V] logits (math dtype; slot columns are overwritten with -inf), e [C, V] or None,
    idx [C, K1] int32 local slot columns (-1: not on this shard).
    Returns zg [C, K1] (logits at the slots, -inf where not owned) and stat [C, 3] = (a, sum exp(u - a),
    sum exp(z - a T)) over the non-slot columns."""
    c, v = z.shape
    k1 = idx.shape[1]
    zg = torch.empty((c, k1), dtype=z.dtype, device=z.device)
    stat = torch.empty((c, 3), dtype=z.dtype, device=z.device)
    if c == 0:
        return zg, stat
    assert z.stride(1) == 1 and idx.is_contiguous() and (e is None or e.stride(1) == 1)
    bl = _block(v, block)
    _row_sweep_kernel[(c,)](
        z, z.stride(0), z if e is None else e, 0 if e is None else e.stride(0), idx, zg, stat, v, k1,
        1.0 / temperature, float(temperature), float(slack), BLOCK=bl, KP=max(2, triton.next_power_of_2(k1)),
        WRITE_E=e is not None, NEED_S1=need_s1, ACC=_acc(z.dtype), num_warps=8 if bl >= 2048 else 4)
    return zg, stat


def row_grad(z, d, coef, temperature: float, need_b: bool, block: int | None = None):
    """d[r] = A exp(z[r]/T - lse) + B exp(z[r] - lse1) with coef [C, 4] = (A, lse, B, lse1)."""
    c, v = z.shape
    if c == 0:
        return d
    assert z.stride(1) == 1 and d.stride(1) == 1 and coef.is_contiguous()
    bl = _block(v, block)
    _row_grad_kernel[(c,)](z, z.stride(0), d, d.stride(0), coef, v, 1.0 / temperature, BLOCK=bl,
                           NEED_B=need_b, ACC=_acc(z.dtype), num_warps=8 if bl >= 2048 else 4)
    return d
