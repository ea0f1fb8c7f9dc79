"""AdamW on bf16 weights whose fp32 master value is the weight plus a 16-bit remainder.

fp32 bits = (bf16 bits << 16) + remainder (int16, signed): the bf16 weight is the master rounded to nearest
(ties away from zero in magnitude bits), the remainder the exact difference, so the master costs 2 bytes
beside the weight instead of 4 and no precision is lost. Moments may be fp32 or bf16.
One Triton pass per tensor on CUDA; the same math in torch ops elsewhere (CPU, tests).
"""
import math

import torch

try:  # optional: the torch path below covers CPU and machines without Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def join_master(weight: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """fp32 master from a bf16 weight and its int16 remainder."""
    hi = weight.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((hi << 16) + rem.to(torch.int64)) & 0xFFFFFFFF
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)  # as a signed 32-bit pattern
    return bits.to(torch.int32).view(torch.float32)


def split_master(master: torch.Tensor, weight: torch.Tensor, rem: torch.Tensor) -> None:
    """weight (bf16) <- master rounded to nearest; rem (int16) <- the exact difference in bits."""
    m32 = master.float().contiguous()
    bits = m32.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = ((bits + 0x8000) >> 16) & 0xFFFF  # +0x8000: the difference then lies in [-2^15, 2^15 - 1]
    low = bits - (hi << 16)
    low = torch.where(low >= 1 << 31, low - (1 << 32), low)  # wrap (only for the top bf16 pattern)
    nan = torch.isnan(m32)  # a NaN's rounding can carry into -0.0 (GPUs' NaN is 0x7FFFFFFF): keep it a NaN
    hi = torch.where(nan, torch.full_like(hi, 0x7FC0), hi)
    low = torch.where(nan, torch.zeros_like(low), low)
    hi = torch.where(hi >= 1 << 15, hi - (1 << 16), hi)
    weight.copy_(hi.to(torch.int16).view(torch.bfloat16).view_as(weight))
    rem.copy_(low.to(torch.int16).view_as(rem))


def adamw_update_(x, g, m, v, lr, b1, b2, eps, wd, bc1, bc2) -> None:
    """The AdamW step in torch ops on an fp32 (or fp64) tensor x; m and v keep their own dtypes."""
    gf = g.to(x.dtype)
    mf = m.to(x.dtype).mul_(b1).add_(gf, alpha=1 - b1)
    vf = v.to(x.dtype).mul_(b2).addcmul_(gf, gf, value=1 - b2)
    x.mul_(1 - lr * wd)
    x.sub_(lr * (mf / bc1) / ((vf / bc2).sqrt() + eps))
    m.copy_(mf)
    v.copy_(vf)


def _step_torch(w, rem, g, m, v, *args):
    x = join_master(w, rem)
    adamw_update_(x, g, m, v, *args)
    split_master(x, w, rem)


if triton is not None:
    @triton.jit
    def _adam_kernel(w_ptr, r_ptr, g_ptr, m_ptr, v_ptr, n, lr, b1, b2, eps, wd, bc1, bc2, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        hi = tl.load(w_ptr + offs, mask=ok).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        lo = tl.load(r_ptr + offs, mask=ok).to(tl.int32)
        x = ((hi << 16) + lo).to(tl.float32, bitcast=True)
        g = tl.load(g_ptr + offs, mask=ok).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=ok).to(tl.float32) * b1 + (1 - b1) * g
        v = tl.load(v_ptr + offs, mask=ok).to(tl.float32) * b2 + (1 - b2) * g * g
        x = x * (1 - lr * wd) - lr * (m / bc1) / (tl.sqrt(v / bc2) + eps)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=ok)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=ok)
        bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        hi2 = ((bits + 0x8000) >> 16) & 0xFFFF
        lo2 = bits - (hi2 << 16)
        lo2 = tl.where(lo2 >= 2147483648, lo2 - 4294967296, lo2)
        nan = x != x  # a NaN's rounding can carry into -0.0 (GPUs' NaN is 0x7FFFFFFF): keep it a NaN
        hi2 = tl.where(nan, 0x7FC0, hi2)
        lo2 = tl.where(nan, 0, lo2)
        tl.store(w_ptr + offs, hi2.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=ok)
        tl.store(r_ptr + offs, lo2.to(tl.int16), mask=ok)


def use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors; CPU tensors only when the kernel was built under TRITON_INTERPRET=1 (tests)."""
    return triton is not None and (t.is_cuda or type(_adam_kernel).__name__ == "InterpretedFunction")


def adamw_step_(weight, rem, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                block: int = 4096) -> None:
    """One AdamW step (decoupled weight decay, bias correction at `step`, 1-based) in place on all five."""
    if weight.dtype != torch.bfloat16 or rem.dtype != torch.int16:
        raise ValueError(f"weight must be bf16 and its remainder int16, got {weight.dtype} / {rem.dtype}")
    for name, t in (("remainder", rem), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != weight.shape or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous with the weight's shape {tuple(weight.shape)}, "
                             f"got {tuple(t.shape)}")
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    args = (float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), float(bc1), float(bc2))
    if weight.numel() == 0:
        return
    if use_triton(weight) and weight.is_contiguous():
        n = weight.numel()
        _adam_kernel[(math.ceil(n / block),)](weight, rem, grad, exp_avg, exp_avg_sq, n, *args, BLOCK=block)
    else:
        _step_torch(weight, rem, grad, exp_avg, exp_avg_sq, *args)
