"""Triton sweep over anchored bf16 logits stored vocabulary-major: y^T [V, S] = (z - b)^T, one column per token.

cuBLASLt adds a bias per output column in the GEMM epilogue, so the logits GEMM can write y = z - b with a
per-token anchor b before its single rounding to bf16: |y| stays small where the softmax mass is, which keeps
bf16's relative error (2^-9 |y|) small there, and no fp32 logits buffer is needed.

anchor_logits: b[r] = max over a few slot ids of h[r] . w[id] (fp32 dots, no [S, J, H] gather), 0 if none.
col_sweep: in place, y -> E = exp(y / T) (slot entries already hold -inf, so they become 0), and per token the
    sum of E and the max of y, as partial results per vocabulary split (summed / maxed in torch). Grid: token
    blocks x vocabulary splits, so a few thousand tokens still fill the GPU. No autotuning: it rewrites its
    input, and a tuning re-run would exponentiate twice. The exponent is clamped at 80 (E stays finite in bf16);
    anchored.py flags every row where the clamp could act.
"""
import torch
import triton
import triton.language as tl

from .rows import INTERPRET, _params

# tokens per tile (256 contiguous bytes of bf16), vocabulary rows per step: 3.4 TB/s on an H200, the best of
# 11 tiles timed by benchmarks/fused_profile.py --sweep-tiles (results/fused_profile_anchored_h200.json)
BT, BV, WARPS = 128, 32, 4
PROGRAMS = 1024  # enough programs to cover the SMs several times over (col_sweep(programs=...) to tune)


@triton.jit
def _col_sweep_kernel(y_ptr, S, V, vchunk, s_ptr, m_ptr, prm_ptr, BT: tl.constexpr, BV: tl.constexpr):
    pt = tl.program_id(0)
    pv = tl.program_id(1)
    inv_t = tl.load(prm_ptr).to(tl.float32)
    ts = pt * BT + tl.arange(0, BT)
    tin = ts < S
    v0 = pv * vchunk
    v1 = tl.minimum(V, v0 + vchunk)
    # elementwise accumulators, reduced once after the loop (no cross-warp reduction per step)
    s = tl.zeros([BV, BT], tl.float32)
    mx = tl.full([BV, BT], float("-inf"), tl.float32)
    for start in range(v0, v1, BV):
        vs = start + tl.arange(0, BV)
        m = (vs < v1)[:, None] & tin[None, :]
        at = y_ptr + vs[:, None].to(tl.int64) * S + ts[None, :]
        y = tl.load(at, mask=m, other=float("-inf")).to(tl.float32)
        mx = tl.maximum(mx, y)
        ex = tl.exp(tl.minimum(y * inv_t, 80.0))  # finite in bf16 even for a flagged row (its scale is 0)
        s += ex
        tl.store(at, ex.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + pv * S + ts, tl.sum(s, 0), mask=tin)
    tl.store(m_ptr + pv * S + ts, tl.max(mx, 0), mask=tin)


def col_sweep(yt: torch.Tensor, temperature: float, bt: int | None = None, bv: int | None = None,
              warps: int | None = None, programs: int | None = None):
    """yt [V, S] contiguous (y = z - b, slot entries -inf) becomes E = exp(y / T) in place.
    Returns (sum of E [S], max of y [S]) in fp32."""
    v, s = yt.shape
    assert yt.is_contiguous()
    bt = bt or (16 if INTERPRET else BT)
    bv = bv or (16 if INTERPRET else BV)
    nt = triton.cdiv(s, bt)
    splits = max(1, min(triton.cdiv(v, bv), (programs or PROGRAMS) // nt))
    vchunk = triton.cdiv(triton.cdiv(v, splits), bv) * bv
    splits = triton.cdiv(v, vchunk)
    part_s = torch.empty((splits, s), dtype=torch.float32, device=yt.device)
    part_m = torch.empty((splits, s), dtype=torch.float32, device=yt.device)
    if s and v:
        _col_sweep_kernel[(nt, splits)](yt, s, v, vchunk, part_s, part_m,
                                        _params(yt.device, torch.float32, temperature), BT=bt, BV=bv,
                                        num_warps=warps or WARPS)
    return part_s.sum(0), part_m.amax(0) if splits else part_m.sum(0)


@triton.jit
def _anchor_kernel(h_ptr, h_stride, w_ptr, w_stride, idx_ptr, idx_stride, out_ptr, H, J,
                   JP: tl.constexpr, BH: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, JP)
    ids = tl.load(idx_ptr + r * idx_stride + js, mask=js < J, other=-1)
    ok = ids >= 0
    acc = tl.zeros([JP], tl.float32)
    for k0 in range(0, H, BH):
        ks = k0 + tl.arange(0, BH)
        km = ks < H
        hv = tl.load(h_ptr + r * h_stride + ks, mask=km, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + ids.to(tl.int64)[:, None] * w_stride + ks[None, :], mask=ok[:, None] & km[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.sum(wv * hv[None, :], 1)
    b = tl.max(tl.where(ok, acc, float("-inf")), 0)
    tl.store(out_ptr + r, tl.where(b == float("-inf"), 0.0, b))


def anchor_logits(h: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[C] in h's dtype: max over idx's columns (int32 local ids, -1 = none) of h[r] . w[id]; 0 where none."""
    c, j = idx.shape
    out = torch.zeros(c, dtype=h.dtype, device=h.device)
    if c and j:
        assert h.stride(1) == 1 and w.stride(1) == 1 and idx.stride(1) == 1
        _anchor_kernel[(c,)](h, h.stride(0), w, w.stride(0), idx, idx.stride(0), out, h.shape[1], j,
                             JP=max(2, triton.next_power_of_2(j)), BH=64 if INTERPRET else 256, num_warps=4)
    return out
