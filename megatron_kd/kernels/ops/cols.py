"""Triton sweep over anchored bf16 logits stored vocabulary-major: y^T [V, S] = (z - b)^T, one column per token.

cuBLASLt adds a bias per output column in the GEMM epilogue, so the logits GEMM can write y = z - b with a
per-token anchor b before its single rounding to bf16: |y| stays small where the softmax mass is, which keeps
bf16's relative error (2^-9 |y|) small there, and no fp32 logits buffer is needed.

col_sweep: in place, y -> E = exp(y / T) (slot entries already hold -inf, so they become 0), and per token the
    sum of E and the max of y, as partial results per vocabulary split (summed / maxed in torch). Grid: token
    blocks x vocabulary splits, so a few thousand tokens still fill the GPU. No autotuning: it rewrites its
    input, and a tuning re-run would exponentiate twice.
"""
import torch
import triton
import triton.language as tl

from .rows import INTERPRET, _params

BT, BV, WARPS = 64, 64, 4  # tokens per tile (128 contiguous bytes of bf16), vocabulary rows per step
PROGRAMS = 1024  # enough programs to cover the SMs several times over


@triton.jit
def _col_sweep_kernel(y_ptr, S, V, vchunk, s_ptr, m_ptr, prm_ptr, BT: tl.constexpr, BV: tl.constexpr):
    pt = tl.program_id(0)
    pv = tl.program_id(1)
    inv_t = tl.load(prm_ptr).to(tl.float32)
    ts = pt * BT + tl.arange(0, BT)
    tin = ts < S
    v0 = pv * vchunk
    v1 = tl.minimum(V, v0 + vchunk)
    s = tl.zeros([BT], tl.float32)
    mx = tl.full([BT], float("-inf"), tl.float32)
    for start in range(v0, v1, BV):
        vs = start + tl.arange(0, BV)
        m = (vs < v1)[:, None] & tin[None, :]
        at = y_ptr + vs[:, None].to(tl.int64) * S + ts[None, :]
        y = tl.load(at, mask=m, other=float("-inf")).to(tl.float32)
        mx = tl.maximum(mx, tl.max(y, 0))
        ex = tl.exp(y * inv_t)
        s += tl.sum(ex, 0)
        tl.store(at, ex.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + pv * S + ts, s, mask=tin)
    tl.store(m_ptr + pv * S + ts, mx, mask=tin)


def col_sweep(yt: torch.Tensor, temperature: float, bt: int | None = None, bv: int | None = None):
    """yt [V, S] contiguous (y = z - b, slot entries -inf) becomes E = exp(y / T) in place.
    Returns (sum of E [S], max of y [S]) in fp32."""
    v, s = yt.shape
    assert yt.is_contiguous()
    bt = bt or (16 if INTERPRET else BT)
    bv = bv or (16 if INTERPRET else BV)
    nt = triton.cdiv(s, bt)
    splits = max(1, min(triton.cdiv(v, bv), PROGRAMS // nt))
    vchunk = triton.cdiv(triton.cdiv(v, splits), bv) * bv
    splits = triton.cdiv(v, vchunk)
    part_s = torch.empty((splits, s), dtype=torch.float32, device=yt.device)
    part_m = torch.empty((splits, s), dtype=torch.float32, device=yt.device)
    if s and v:
        _col_sweep_kernel[(nt, splits)](yt, s, v, vchunk, part_s, part_m,
                                        _params(yt.device, torch.float32, temperature), BT=bt, BV=bv,
                                        num_warps=WARPS)
    return part_s.sum(0), part_m.amax(0) if splits else part_m.sum(0)
