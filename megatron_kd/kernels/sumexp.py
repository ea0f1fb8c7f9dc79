"""sum_exp_rows: per row of a logit block, sum_j exp(x_j - m) accumulated in fp64, and the count of non-finite x_j,
in one read of the block in its own dtype (bf16 logits are never widened to an fp32 copy in memory).

exp is libdevice's expf (what torch.exp runs on fp32 CUDA tensors), taken of the fp32 difference x - m, so each
term equals torch.exp(x.float() - m); only the order of the fp64 additions differs from torch's reduction. Rows are
split into column spans summed separately and added in a fixed order, so the result is deterministic.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import EXACT_COMPILE

SPAN = 16384  # columns per program: enough programs to fill the GPU at a few hundred rows


@triton.jit
def _sum_exp_kernel(x_ptr, x_stride, m_ptr, part_ptr, bad_ptr, W, SPLITS, BLOCK: tl.constexpr, SPAN: tl.constexpr,
                    LIBDEVICE: tl.constexpr):
    row = tl.program_id(0)
    sp = tl.program_id(1)
    m = tl.load(m_ptr + row)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    base = x_ptr + row.to(tl.int64) * x_stride
    for off in range(0, SPAN, BLOCK):
        cols = sp * SPAN + off + tl.arange(0, BLOCK)
        ok = cols < W
        x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        if LIBDEVICE:
            e = libdevice.exp(x - m)
        else:  # Triton's CPU interpreter has no libdevice: numpy's exp (tests compare within rounding)
            e = tl.exp(x - m)
        acc += tl.where(ok, e.to(tl.float64), 0.0)
        finite = (x == x) & (tl.abs(x) < float("inf"))
        bad += tl.where(ok & (finite == 0), 1, 0)
    tl.store(part_ptr + row * SPLITS + sp, tl.sum(acc, axis=0))
    tl.store(bad_ptr + row * SPLITS + sp, tl.sum(bad, axis=0))


def sum_exp_rows(x: torch.Tensor, m: torch.Tensor, block: int = 2048):
    """x [n, w] (any float dtype, unit column stride), m [n] fp32 -> (s [n] fp64 = sum_j exp(x_j - m),
    nonfinite [n] int32 = how many x_j are NaN or +-inf)."""
    n, w = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    splits = max(1, triton.cdiv(w, SPAN))
    part = torch.empty(n, splits, dtype=torch.float64, device=x.device)
    bad = torch.empty(n, splits, dtype=torch.int32, device=x.device)
    if n:
        _sum_exp_kernel[(n, splits)](x, x.stride(0), m.float().contiguous(), part, bad, w, splits,
                                     BLOCK=block, SPAN=SPAN, LIBDEVICE=x.is_cuda, **EXACT_COMPILE)
    return part.sum(dim=1), bad.sum(dim=1, dtype=torch.int32)
