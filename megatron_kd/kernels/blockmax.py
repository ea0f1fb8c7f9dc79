"""block_max_rows: per row of a logit block, the largest value of each full block of `block` columns, in one read of
the block in its own dtype.

The maximum is taken in the total order torch.topk ranks floats by (-0.0 below +0.0; NaN at the ends): each value's
bits become an integer key that is monotone in that order, the keys are maxed, and the winner's bits come back
unchanged. So a block's maximum is one of its own values, bit for bit, and blocks compare as topk compares values,
which is what the top-K's block prefilter needs of them (parallel/topk.py, _block_topk).
"""
import torch
import triton
import triton.language as tl

BLOCKS_PER_PROGRAM = 64  # blocks of one row per program (64 x 64 columns: 8 KiB of bf16 read per program)

_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@triton.jit
def _block_max_kernel(x_ptr, x_stride, out_ptr, out_stride, NB, BLOCK: tl.constexpr, TILE: tl.constexpr,
                      WIDE: tl.constexpr):
    row = tl.program_id(0)
    b = tl.program_id(1) * TILE + tl.arange(0, TILE)
    c = tl.arange(0, BLOCK)
    ok = b < NB
    ptrs = x_ptr + row.to(tl.int64) * x_stride + b[:, None] * BLOCK + c[None, :]
    if WIDE:  # 32-bit floats: keys in int64
        s = tl.load(ptrs, mask=ok[:, None], other=0).to(tl.int64)
        key = s ^ ((s >> 31) & 0x7FFFFFFF)  # negative floats: lower bits flipped, so larger magnitude ranks lower
        top = tl.max(key, axis=1)
        out = (top ^ ((top >> 31) & 0x7FFFFFFF)).to(tl.int32)
    else:  # 16-bit floats: keys in int32
        s = tl.load(ptrs, mask=ok[:, None], other=0).to(tl.int32)
        key = s ^ ((s >> 15) & 0x7FFF)
        top = tl.max(key, axis=1)
        out = (top ^ ((top >> 15) & 0x7FFF)).to(tl.int16)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + b, out, mask=ok)


def block_max_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [n, w] (bf16, fp16 or fp32, unit column stride), block a power of two -> [n, w // block] in x's dtype: the
    maximum of each row's full blocks of `block` columns (a trailing partial block is left out)."""
    n, w = x.shape
    if x.dtype not in _INT:
        raise ValueError(f"block_max_rows takes bf16, fp16 or fp32, not {x.dtype}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two")
    if x.stride(1) != 1:
        x = x.contiguous()
    nb = w // block
    out = torch.empty(n, nb, dtype=x.dtype, device=x.device)
    if n and nb:
        it = _INT[x.dtype]
        _block_max_kernel[(n, triton.cdiv(nb, BLOCKS_PER_PROGRAM))](
            x.view(it), x.stride(0), out.view(it), out.stride(0), nb, BLOCK=block, TILE=BLOCKS_PER_PROGRAM,
            WIDE=x.dtype == torch.float32)
    return out
