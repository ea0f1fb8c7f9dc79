"""swiglu_eager: megatron-core's unfused gated-SiLU (`silu(a) * (b + offset)` over the two halves of fc1's output) in
one read of the input and one write, with the eager composition's rounding.

Eager runs three kernels, each rounding its result to the input dtype: silu(a) = a / (1 + exp(-a)) in fp32 (expf,
IEEE division), b + offset in fp32, and their product in fp32. This kernel computes the same fp32 values with the
same functions (libdevice expf, div_rn) and rounds at the same three places, so its output equals eager's bit for
bit; only the memory traffic of the two intermediate tensors is gone. Forward only (no autograd).
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import EXACT_COMPILE


@triton.jit
def _swiglu_kernel(x_ptr, out_ptr, F, x_stride, out_stride, offset, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    a_raw = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
    b_raw = tl.load(x_ptr + row * x_stride + F + cols, mask=ok, other=0.0)
    a = a_raw.to(tl.float32)
    if LIBDEVICE:
        silu = libdevice.div_rn(a, 1.0 + libdevice.exp(-a))
    else:  # Triton's CPU interpreter has no libdevice
        silu = a / (1.0 + tl.exp(-a))
    silu = silu.to(a_raw.dtype).to(tl.float32)
    lin = (b_raw.to(tl.float32) + offset).to(b_raw.dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (silu * lin).to(a_raw.dtype), mask=ok)


def swiglu_eager(x: torch.Tensor, offset: float = 0.0, block: int = 1024) -> torch.Tensor:
    """x [..., 2F] (16-bit float, rows of unit column stride) -> silu(x[..., :F]) * (x[..., F:] + offset) [..., F],
    bit-identical to the eager composition on CUDA."""
    *lead, two_f = x.shape
    f = two_f // 2
    rows = x.reshape(-1, two_f)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], f, dtype=x.dtype, device=x.device)
    if rows.shape[0] and f:
        grid = (rows.shape[0], triton.cdiv(f, block))
        _swiglu_kernel[grid](rows, out, f, rows.stride(0), out.stride(0), float(offset), BLOCK=block,
                             LIBDEVICE=x.is_cuda, **EXACT_COMPILE)
    return out.reshape(*lead, f)
