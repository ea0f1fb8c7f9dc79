"""kernels.sumexp against torch in float64 on fresh random logit blocks (bf16, fp16, fp32; rows wider and narrower
than one program's span; strided rows; NaN and infinities counted). On CPU under Triton's interpreter (numpy's exp:
equal within rounding); on a GPU every term is libdevice's expf, the function torch.exp runs, so the sums agree to
the order of the fp64 additions."""
import pytest
import torch

from fused_harness import DEV  # noqa: F401  (sets TRITON_INTERPRET first)

from megatron_kd.kernels.sumexp import SPAN, sum_exp_rows  # noqa: E402


def reference(x, m):
    u = x.double()
    return torch.exp(u - m.double()[:, None]).sum(dim=1), (~torch.isfinite(x)).sum(dim=1)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sum_exp_rows_against_float64(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (1,), generator=g))
    w = int(torch.randint(1, 2 * SPAN + 500, (1,), generator=g)) if seed % 2 else int(torch.randint(1, 300, (1,),
                                                                                                    generator=g))
    full = (torch.randn(n, w + 5, generator=g) * 4).to(dtype)
    x = full[:, 2:w + 2]  # a strided view, as a vocab shard's valid columns are
    m = x.float().amax(dim=1) + torch.rand(n, generator=g)  # any anchor, not only the max
    s, bad = sum_exp_rows(x.to(DEV), m.to(DEV))
    r, rbad = reference(x, m)
    assert torch.allclose(s.cpu(), r, rtol=1e-6 if not x.is_cuda else 1e-12, atol=0)
    assert torch.equal(bad.cpu().long(), rbad)


def test_non_finite_values_are_counted():
    x = torch.randn(3, SPAN + 7)
    x[0, 5], x[1, SPAN + 3], x[2, 0], x[2, 1] = float("nan"), float("inf"), float("-inf"), float("nan")
    s, bad = sum_exp_rows(x.to(DEV), torch.zeros(3, device=DEV))
    assert bad.cpu().tolist() == [1, 1, 2]
    assert torch.isnan(s[0]) and torch.isinf(s[1]) or torch.isnan(s[1])


@pytest.mark.gpu
def test_terms_are_torch_exp_bit_for_bit():
    """One column per row: the sum is the single term, which must be torch.exp's fp32 value exactly."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(1 << 20, 1, generator=g, device="cuda") * 8).to(dtype)
        m = torch.randn(1 << 20, generator=g, device="cuda") * 8
        s, _ = sum_exp_rows(x, m)
        want = torch.exp(x.float()[:, 0] - m).double()
        assert torch.equal(s, want)
