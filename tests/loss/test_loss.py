"""Every torch impl against the independent float64 reference: losses and both gradients."""
import itertools

import pytest
import torch

from megatron_kd import topk_kl_loss
from reference import make_inputs, reference_loss

IMPLS = ["dense", "chunked", "forward_chunked"]
TAILS = ["none", "renormalize", "bucket"]
DIVERGENCES = [dict(divergence="forward_kl"), dict(divergence="reverse_kl"), dict(divergence="jsd", jsd_beta=0.5),
               dict(divergence="jsd", jsd_beta=0.2)]
DIV_IDS = ["fkl", "rkl", "jsd0.5", "jsd0.2"]


def run_both(inp, impl, chunk_size=4, **kw):
    h = inp["hidden"].clone().requires_grad_(True)
    w = inp["weight"].clone().requires_grad_(True)
    out = topk_kl_loss(h, w, inp["ids"], inp["logp"], labels=inp["labels"], loss_mask=inp["loss_mask"],
                       impl=impl, chunk_size=chunk_size, **kw)
    h64 = inp["hidden"].double().clone().requires_grad_(True)
    w64 = inp["weight"].double().clone().requires_grad_(True)
    ref = reference_loss(h64, w64, inp["ids"], inp["logp"].double(), inp["labels"], inp["loss_mask"], **kw)
    gout = torch.randn(out.shape, dtype=torch.float64) if out.dim() else torch.tensor(1.7, dtype=torch.float64)
    (out.double() * gout).sum().backward()
    (ref * gout).sum().backward()
    return (out.detach().double(), ref.detach()), (h.grad.double(), h64.grad), (w.grad.double(), w64.grad)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("div", DIVERGENCES, ids=DIV_IDS)
@pytest.mark.parametrize("impl,tail,reduction", list(itertools.product(IMPLS, TAILS, ["mean", "sum", "none"])))
@pytest.mark.parametrize("temperature,kl_weight,ce_weight", [(1.0, 1.0, 0.0), (2.5, 0.7, 0.4)])
def test_fp64_matches_reference(impl, tail, reduction, temperature, kl_weight, ce_weight, div):
    inp = make_inputs(n_shape=(3, 7), seed=hash((impl, tail, reduction, temperature)) % 1000)
    for a, b in run_both(inp, impl, tail=tail, reduction=reduction, temperature=temperature,
                         kl_weight=kl_weight, ce_weight=ce_weight, **div):
        assert rel_err(a, b) <= 1e-9, (impl, tail, reduction, div)


@pytest.mark.parametrize("div", DIVERGENCES, ids=DIV_IDS)
@pytest.mark.parametrize("impl,tail", list(itertools.product(IMPLS, TAILS)))
def test_fp32_matches_reference(impl, tail, div):
    inp = make_inputs(n_shape=(37,), V=300, H=24, K=9, dtype=torch.float32, seed=7)
    for a, b in run_both(inp, impl, chunk_size=8, tail=tail, temperature=1.3, ce_weight=0.5, **div):
        assert rel_err(a, b) <= 1e-4


def test_bf16_inputs_compute_in_fp32():
    inp = make_inputs(n_shape=(33,), V=200, H=32, K=8, dtype=torch.bfloat16, seed=3)
    inp["hidden"] = inp["hidden"].to(torch.bfloat16)
    out = topk_kl_loss(inp["hidden"], inp["weight"], inp["ids"], inp["logp"], impl="chunked", chunk_size=5)
    assert out.dtype == torch.float32
    ref = reference_loss(inp["hidden"], inp["weight"], inp["ids"], inp["logp"])
    assert abs(out.item() - ref.item()) / abs(ref.item()) < 1e-4  # same bf16 operands, fp32 math


@pytest.mark.parametrize("div", DIVERGENCES[:3], ids=DIV_IDS[:3])
@pytest.mark.parametrize("impl", IMPLS)
def test_uneven_chunks_and_noncontiguous(impl, div):
    base = make_inputs(n_shape=(5, 11), V=40, seed=11)
    # non-contiguous views of the same values
    inp = dict(base)
    inp["hidden"] = base["hidden"].transpose(0, 1).contiguous().transpose(0, 1)
    inp["ids"] = base["ids"].transpose(0, 1).contiguous().transpose(0, 1)
    inp["logp"] = base["logp"].transpose(0, 1).contiguous().transpose(0, 1)
    assert not inp["hidden"].is_contiguous()
    for cs in (1, 3, 7, 55, 1000):
        for a, b in run_both(inp, impl, chunk_size=cs, tail="bucket", ce_weight=0.2, **div):
            assert rel_err(a, b) <= 1e-9


@pytest.mark.parametrize("impl", IMPLS)
def test_nothing_counted_is_zero_not_nan(impl):
    inp = make_inputs(n_shape=(6,), seed=2)
    inp["loss_mask"] = torch.zeros(6, dtype=torch.float64)
    h = inp["hidden"].clone().requires_grad_(True)
    out = topk_kl_loss(h, inp["weight"], inp["ids"], inp["logp"], loss_mask=inp["loss_mask"], impl=impl)
    out.backward()
    assert out.item() == 0.0 and torch.all(h.grad == 0)


@pytest.mark.parametrize("div", DIVERGENCES[:3], ids=DIV_IDS[:3])
@pytest.mark.parametrize("tail", TAILS)
def test_all_slots_empty(tail, div):
    inp = make_inputs(n_shape=(4,), seed=5, empty_frac=1.0)
    for impl in IMPLS:
        for a, b in run_both(inp, impl, tail=tail, ce_weight=0.3, **div):
            assert torch.isfinite(a).all() and rel_err(a, b) <= 1e-9


@pytest.mark.parametrize("div", DIVERGENCES[:3], ids=DIV_IDS[:3])
def test_padded_vocab_excluded(div):
    inp = make_inputs(n_shape=(9,), V=30, seed=4)
    inp["ids"] = inp["ids"].masked_fill(inp["ids"] >= 25, -1)  # teacher never names padding ids
    for impl in IMPLS:
        for a, b in run_both(inp, impl, valid_vocab_size=25, ce_weight=0.0, tail="bucket", **div):
            assert rel_err(a, b) <= 1e-9


@pytest.mark.parametrize("div", DIVERGENCES[:3], ids=DIV_IDS[:3])
@pytest.mark.parametrize("impl,tail", list(itertools.product(IMPLS, TAILS)))
def test_gradcheck(impl, tail, div):
    inp = make_inputs(n_shape=(5,), V=12, H=4, K=3, seed=9)
    inp["labels"] = inp["labels"].clamp(min=0)

    def f(h, w):
        return topk_kl_loss(h, w, inp["ids"], inp["logp"], labels=inp["labels"], loss_mask=inp["loss_mask"],
                            impl=impl, chunk_size=2, tail=tail, temperature=1.5, ce_weight=0.3, **div)
    h = inp["hidden"].clone().requires_grad_(True)
    w = inp["weight"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (h, w), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("div", DIVERGENCES[:3], ids=DIV_IDS[:3])
def test_impls_agree_exactly_on_fp64(div):
    inp = make_inputs(n_shape=(4, 9), seed=21)
    outs = [run_both(inp, impl, chunk_size=5, tail="bucket", temperature=0.8, ce_weight=0.1, **div)[0][0]
            for impl in IMPLS]
    for o in outs[1:]:
        assert rel_err(o, outs[0]) <= 1e-12
