"""kernels.blockmax against torch on fresh random logit blocks (bf16, fp16, fp32; widths with and without a trailing
partial block; strided rows; rows spanning several programs): every block's maximum bit for bit, in the order
torch.topk ranks floats (-0.0 below +0.0), also with signed zeros, subnormals and infinities in random places; and
torch.amax's value wherever a block holds no zero of either sign. On CPU under Triton's interpreter, on a GPU as is.
"""
import pytest
import torch

from fused_harness import DEV  # noqa: F401  (sets TRITON_INTERPRET first)

from megatron_kd.kernels.blockmax import BLOCKS_PER_PROGRAM, block_max_rows  # noqa: E402

INT = {torch.bfloat16: (torch.int16, 16), torch.float16: (torch.int16, 16), torch.float32: (torch.int32, 32)}


def reference(x, block):
    """The block maxima through integer keys monotone in topk's order, in int64 (independent of the kernel's)."""
    it, bits = INT[x.dtype]
    s = x.contiguous().view(it).to(torch.int64)
    low = (1 << (bits - 1)) - 1
    key = torch.where(s < 0, s ^ low, s)
    n, nb = x.shape[0], x.shape[1] // block
    top = key[:, :nb * block].reshape(n, nb, block).amax(2)
    return torch.where(top < 0, top ^ low, top).to(it).view(x.dtype)


def _logits(g, n, w, dtype, specials):
    x = torch.randn(n, w, generator=g) * 3
    x[::2] = -x[::2].abs()  # rows of negative values only: their blocks' maxima are the smallest magnitudes
    x = x.to(dtype)
    if specials:
        tiny = torch.finfo(dtype).tiny
        vals = torch.tensor([0.0, -0.0, tiny / 4, -tiny / 4, float("inf"), float("-inf")], dtype=torch.float32)
        pos = torch.randint(0, n * w, (max(1, n * w // 50),), generator=g)
        x.view(-1)[pos] = vals[torch.randint(0, len(vals), pos.shape, generator=g)].to(dtype)
    return x


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("specials", [False, True], ids=["plain", "zeros_subnormals_infs"])
def test_block_max_rows_bit_for_bit(seed, dtype, specials):
    g = torch.Generator().manual_seed(seed)
    block = 64
    for n, w in ((3, 64 * BLOCKS_PER_PROGRAM * 2 + 64 * 5 + 17), (5, 64 * 7), (2, 40)):
        x = _logits(g, n, w, dtype, specials)
        got = block_max_rows(x.to(DEV), block).cpu()
        want = reference(x, block)
        assert got.shape == (n, w // block) and got.dtype == dtype
        it = INT[dtype][0]
        assert torch.equal(got.view(it), want.view(it)), (dtype, n, w)
        if not specials:
            assert torch.equal(got, x[:, :w // block * block].reshape(n, -1, block).amax(2))


def test_signed_zero_ranks_as_topk_ranks_it():
    x = torch.tensor([[-0.0] * 63 + [0.0], [-0.0] * 64, [-1.0] * 63 + [-0.0]], dtype=torch.bfloat16)
    got = block_max_rows(x.to(DEV), 64).cpu()
    assert got.view(torch.int16)[:, 0].tolist() == [0, -32768, -32768]  # +0.0, -0.0, -0.0 (not -1.0)


def test_strided_rows_and_other_blocks():
    g = torch.Generator().manual_seed(9)
    wide = (torch.randn(4, 1000, generator=g) * 2).to(torch.bfloat16)
    x = wide[:, 3:3 + 900]  # row stride 1000, unit column stride
    for block in (16, 64, 128):
        assert torch.equal(block_max_rows(x.to(DEV), block).cpu(), reference(x, block))
    with pytest.raises(ValueError, match="power of two"):
        block_max_rows(x, 48)
