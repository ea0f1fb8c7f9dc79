"""rope_eager: megatron-core's unfused rotary embedding (`t * cos + rotate_half(t) * sin`, non-interleaved, the
rotation over the whole head) in one read of t and one write, with the eager composition's rounding.

Eager rounds each product to t's dtype, then their sum, and copies the result once more through `torch.cat`. Products of
two 16-bit floats are exact in fp32, so rounding each to the 16-bit dtype and adding the two in fp32 before rounding
again reproduces eager's result bit for bit, provided the compiler does not contract a product and the sum into one
fused multiply-add (which skips a rounding): the kernel is compiled without fp fusion. cos / sin are passed already
rounded to t's dtype, as eager rounds them. Forward only (no autograd).
"""
import torch
import triton
import triton.language as tl

from . import EXACT_COMPILE


@triton.jit
def _rope_kernel(t_ptr, cos_ptr, sin_ptr, out_ptr, N, B, H, s_stride, b_stride, h_stride, cs_stride,
                 HALF: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (position, batch, head) rows
    ok = (r < N)[:, None]
    s = r // (B * H)
    rem = r % (B * H)
    src = (s * s_stride + (rem // H) * b_stride + (rem % H) * h_stride)[:, None]
    cs = (s * cs_stride)[:, None]
    j = tl.arange(0, HALF)[None, :]
    x1 = tl.load(t_ptr + src + j, mask=ok, other=0.0)
    x2 = tl.load(t_ptr + src + HALF + j, mask=ok, other=0.0)
    c1 = tl.load(cos_ptr + cs + j, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF + j, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs + j, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF + j, mask=ok, other=0.0).to(tl.float32)
    dt = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # first half: x1 * cos - x2 * sin; second half: x2 * cos + x1 * sin (rotate_half = [-x2, x1]). Eager's
    # x1 * cos + (-x2) * sin is written as a difference: IEEE defines a - b as a + (-b) and rounds -p as -(round p),
    # so the bits agree, zeros' signs included, which Triton's unary minus (0 - x) would not keep
    lo = (f1 * c1).to(dt).to(tl.float32) - (f2 * s1).to(dt).to(tl.float32)
    hi = (f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)
    dst = (r * (2 * HALF))[:, None]
    tl.store(out_ptr + dst + j, lo.to(dt), mask=ok)
    tl.store(out_ptr + dst + HALF + j, hi.to(dt), mask=ok)


def rope_eager(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: int = 16) -> torch.Tensor:
    """t [s, b, h, d] (16-bit float, unit stride on d), cos / sin [s, 1, 1, d] in t's dtype -> a new contiguous
    [s, b, h, d] tensor equal bit for bit to megatron-core's unfused `t * cos + rotate_half(t) * sin` on CUDA.
    d must be a power of two (the head dims of the models we run: 64, 128)."""
    s, b, h, d = t.shape
    if t.stride(3) != 1:
        t = t.contiguous()
    cos = cos.reshape(cos.shape[0], d)
    sin = sin.reshape(sin.shape[0], d)
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((s, b, h, d), dtype=t.dtype, device=t.device)
    if t.numel():
        n = s * b * h
        _rope_kernel[(triton.cdiv(n, rows),)](t, cos, sin, out, n, b, h, t.stride(0), t.stride(1), t.stride(2),
                                              cos.stride(0), HALF=d // 2, ROWS=rows, **EXACT_COMPILE)
    return out
