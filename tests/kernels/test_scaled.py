"""kernels.scaled (one Triton program per row) against the torch bookkeeping it replaces on the scaled path:
sparse.combine_stats + sparse.grad_coefficients + the row scale, on random slot logits with duplicate ids,
empty slots, labels that repeat a teacher id or are ignored, zero-weight rows, flagged rows and T != 1."""
import pytest
import torch

from fused_harness import DEV, rel, run_fused  # sets TRITON_INTERPRET first

from megatron_kd.kernels.scaled import scaled_rows  # noqa: E402
from megatron_kd.loss.sparse import combine_stats, grad_coefficients, prepare_slots  # noqa: E402
from megatron_kd.loss.function import row_weights  # noqa: E402
from megatron_kd.loss.inputs import check_and_flatten  # noqa: E402
from megatron_kd.loss.options import LossOptions  # noqa: E402
from megatron_kd.parallel.vocab import VocabShard  # noqa: E402
from reference import make_inputs  # noqa: E402


def torch_rows(zg, stat, bad, sl, t, opts, shard, g):
    st = combine_stats(zg, stat, sl, opts, shard)
    vals, A, B = grad_coefficients(zg, st, t, sl, opts, g)
    assert B is None
    scale = A * torch.exp(stat[:, 0] - st.lse)
    if bad is not None:
        scale = torch.where(bad, torch.zeros_like(scale), scale)
    vals = torch.where((scale != 0)[:, None], vals / scale[:, None], torch.zeros_like(vals))
    return st, scale, vals


def kernel_rows(zg, stat, bad, sl, t, opts, g, vals_dtype):
    """kernels.scaled_rows with the chunk's slots, targets and options unpacked, as loss/fused.py calls it."""
    return scaled_rows(zg, stat[:, 0], stat[:, 1], bad, sl.col, sl.own, t.logp, t.valid, t.labels, g, vals_dtype,
                       temperature=opts.temperature, kl_weight=opts.kl_weight, ce_weight=opts.ce_weight,
                       jsd_beta=opts.jsd_beta, need_kl=opts.needs_kl, need_ce=opts.needs_ce,
                       divergence=opts.divergence, tail=opts.tail, monitor=opts.monitor)


def case(seed, dtype, n=45, V=40, K=7, **kw):
    inp = make_inputs(n_shape=(n,), V=V, H=8, K=K, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    ids = inp["ids"].clone()
    dup = torch.rand(ids.shape, generator=g) < 0.15  # repeat the first id in some slots
    ids = torch.where(dup & (ids >= 0), ids[:, :1].expand_as(ids), ids)
    labels = inp["labels"].clone()
    labels[::4] = ids[::4, 1].clamp_min(0)  # a label that is also a teacher id
    opts = LossOptions(impl="fused", **kw)
    w = inp["weight"]
    shard = VocabShard.build(V)
    h, t, _ = check_and_flatten(inp["hidden"], w, ids, inp["logp"], labels, inp["loss_mask"], opts, vocab_size=V, repeated_ids_ok=True)
    t = type(t)(*(x.to(DEV) if torch.is_tensor(x) else x for x in (t.ids, t.logp, t.valid, t.labels, t.weight)))
    sl = prepare_slots(t, opts, shard)
    mdt = t.logp.dtype
    z = torch.randn(n, sl.k1, generator=g, dtype=torch.float64).mul(3).to(mdt).to(DEV)
    zg = torch.where(sl.own, z, torch.full_like(z, float("-inf")))
    a = torch.maximum(zg.amax(1), torch.randn(n, generator=g, dtype=torch.float64).to(mdt).to(DEV)) / opts.temperature
    se = torch.rand(n, generator=g, dtype=torch.float64).mul(50).to(mdt).to(DEV)
    stat = torch.stack([a, se, torch.zeros_like(se)], 1)
    bad = (torch.rand(n, generator=g) < 0.2).to(DEV)
    return zg, stat, bad, sl, t, opts, shard, row_weights(t, opts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kw", [dict(), dict(ce_weight=0.5), dict(temperature=0.6), dict(kl_weight=0.0, ce_weight=1.0),
                                dict(kl_weight=0.7, temperature=2.0, reduction="sum"),
                                dict(divergence="reverse_kl", temperature=1.3), dict(divergence="jsd", jsd_beta=0.3,
                                                                                    ce_weight=0.5),
                                dict(divergence="reverse_kl", ce_weight=0.2, monitor=True), dict(monitor=True)],
                         ids=["kl", "ce", "T0.6", "ce-only", "T2-sum", "rkl", "jsd-ce", "rkl-monitor", "monitor"])
@pytest.mark.parametrize("with_bad", [False, True])
def test_scaled_rows_matches_torch(dtype, kw, with_bad):
    zg, stat, bad, sl, t, opts, shard, g = case(3, dtype, **kw)
    bad = bad if with_bad else None
    st, scale, vals = torch_rows(zg, stat, bad, sl, t, opts, shard, g)
    lse, uk, zy, scale2, vals2, rest2 = kernel_rows(zg, stat, bad, sl, t, opts, g, dtype)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert (rest2 is None) == (not opts.monitor)
    # reverse KL / JSD: A = -sum(H) over mixed-sign terms, so vals = dz / scale amplifies rounding where A is
    # small; what the gradient uses is scale * vals (= dz at the slot), compared relative to its row's size
    fwd = opts.divergence == "forward_kl" or dtype == torch.float64
    dz2, dz = vals2 * scale2[:, None], vals * scale[:, None]
    assert ((dz2 - dz).abs() <= 4 * tol * dz.abs().amax(1, keepdim=True).clamp_min(1e-30)).all()
    for got, want in [(lse, st.lse), (uk, st.uk), (scale2, scale)] + ([(vals2, vals)] if fwd else []) + \
            ([(zy, st.zy)] if opts.needs_ce else []) + ([(rest2, st.rest_lse)] if opts.monitor else []):
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=tol, atol=tol), (got - want).abs().max()
    assert (zy is None) == (not opts.needs_ce)
    assert (scale2 == 0).any() if with_bad else True


@pytest.mark.parametrize("logits", ["anchored", "fp32"])
@pytest.mark.parametrize("kw", [dict(), dict(ce_weight=0.4, temperature=1.0)], ids=["kl", "ce"])
def test_run_kernel_rows_equal_torch_rows(monkeypatch, logits, kw):
    """The whole fused loss with either bookkeeping (the torch one is the fallback above MAX_SLOTS slots): same loss
    and gradients up to rounding."""
    inp = make_inputs(n_shape=(5, 9), V=300, H=24, K=9, dtype=torch.float32, seed=5)
    inp["hidden"], inp["weight"] = inp["hidden"].bfloat16(), (inp["weight"] * 0.3).bfloat16()
    ids = inp["ids"]
    inp["ids"] = torch.where((ids >= 0) & (torch.arange(9) % 3 == 2), ids[..., :1], ids)  # duplicate ids
    inp["labels"] = torch.where(torch.arange(9) % 2 == 0, inp["ids"][..., 1].clamp_min(0), inp["labels"])
    tune = dict(sub_rows=8, super_rows=16, block=128, logits=logits)
    from megatron_kd.loss import fused
    called = []
    real = fused.scaled_rows
    monkeypatch.setattr(fused, "scaled_rows", lambda *a, **k: called.append(1) or real(*a, **k))
    a = run_fused(inp, 1.0, tune, **kw)
    assert called
    monkeypatch.setattr(fused, "MAX_SLOTS", 0)  # every K1 above it: the torch bookkeeping
    called.clear()
    b = run_fused(inp, 1.0, tune, **kw)
    assert not called
    errs = [rel(x, y) for x, y in zip(a, b)]
    assert errs[0] <= 1e-5 and max(errs[1:]) <= 1e-2, errs  # bf16 gradients: one rounding apart


def test_scaled_rows_refuses_what_it_does_not_cover():
    zg, stat, bad, sl, t, opts, shard, g = case(1, torch.float32, ce_weight=0.5, temperature=2.0)
    with pytest.raises(ValueError, match="CE only at T = 1"):
        kernel_rows(zg, stat, None, sl, t, opts, g, torch.float32)


def test_many_slots_fall_back_to_torch_rows(monkeypatch):
    """K1 above kernels.scaled.MAX_SLOTS: the fused loss keeps the torch bookkeeping (and stays exact)."""
    from megatron_kd.loss import fused
    from fused_harness import run_ref
    monkeypatch.setattr(fused, "MAX_SLOTS", 8)
    called = []
    monkeypatch.setattr(fused, "scaled_rows", lambda *a, **k: called.append(1))
    inp = make_inputs(n_shape=(20,), V=200, H=16, K=9, dtype=torch.float64, seed=4)
    got = run_fused(inp, 1.0, dict(sub_rows=8, super_rows=16, block=128), ce_weight=0.3)
    want = run_ref(inp, 1.0, ce_weight=0.3)
    assert not called and max(rel(a, b) for a, b in zip(got, want)) <= 1e-9


def test_main_grad_backward_runs_once():
    """With main_grad the input gradient is handed over (not kept): a second backward is refused, clearly."""
    inp = make_inputs(n_shape=(20,), V=200, H=16, K=5, dtype=torch.float32, seed=2)
    h = inp["hidden"].to(DEV).requires_grad_(True)
    w = inp["weight"].to(DEV).requires_grad_(True)
    w.main_grad = torch.zeros(w.shape, device=DEV)
    from megatron_kd import topk_kl_loss
    loss = topk_kl_loss(h, w, inp["ids"].to(DEV), inp["logp"].to(DEV), impl="fused")
    loss.backward(retain_graph=True)
    g1 = h.grad.clone()
    h.grad.mul_(0)  # a caller's in-place change must not reach anything the loss still holds
    with pytest.raises(RuntimeError, match="cannot run twice"):
        loss.backward()
    assert torch.isfinite(g1).all() and g1.abs().sum() > 0
