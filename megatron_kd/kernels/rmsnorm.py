"""rms_norm_eager: torch.rms_norm's composite for 16-bit inputs with an fp32 weight (upcast, pow 2, mean, + eps,
rsqrt, two fp32 multiplies, cast back) in three passes over memory instead of eight, with the same bits.

torch runs the composite when the weight's dtype differs from the input's, which is megatron-core's local RMSNorm
(fp32 weight, 16-bit activations); with equal dtypes it runs its own fused kernel, which this does not reproduce.
The mean is torch's own reduction, run on the same fp32 squares eager makes, so its summation order, and therefore
its result, is eager's. Around it two kernels replace the elementwise steps: one writes x.float() ** 2 (an fp32
product, as pow(x, 2) computes it), the other x.float() * rstd * weight in fp32, rounded once to x's dtype, as the
composite multiplies and then casts. Forward only (no autograd).
"""
import torch
import triton
import triton.language as tl

from . import EXACT_COMPILE


@triton.jit
def _square_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, x * x, mask=ok)


@triton.jit
def _scale_kernel(x_ptr, r_ptr, w_ptr, out_ptr, H, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0)
    r = tl.load(r_ptr + row)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = x.to(tl.float32) * r
    tl.store(out_ptr + row * H + cols, (y * w).to(x.dtype), mask=ok)


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float, block: int = 1024) -> torch.Tensor:
    """x [..., H] (16-bit float), weight [H] fp32, eps -> torch.rms_norm(x, (H,), weight, eps), bit-identical on
    CUDA."""
    shape = x.shape
    h = shape[-1]
    rows = x.reshape(-1, h)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    sq = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    n = rows.numel()
    if n:
        _square_kernel[(triton.cdiv(n, block),)](rows, sq, n, BLOCK=block, **EXACT_COMPILE)
    rstd = torch.rsqrt(torch.ops.aten.add.Scalar(sq.mean(dim=-1, keepdim=True), eps))
    del sq
    out = torch.empty_like(rows)
    if n:
        _scale_kernel[(rows.shape[0], triton.cdiv(h, block))](rows, rstd, weight.contiguous(), out, h, BLOCK=block,
                                                            **EXACT_COMPILE)
    return out.reshape(shape)
