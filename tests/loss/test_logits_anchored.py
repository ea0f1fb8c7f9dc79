"""impl="fused" with anchored bf16 logits (loss/logits.py) against the float64 reference.

Three logit scales put none, some and all of the tokens over the anchor bound TAU, so both the common path
and the fp32 redo of flagged tokens (with their weight-gradient contribution taken back out) are checked.
"""
import pytest
import torch

from fused_harness import DEV, TUNE, rel, run_fused, run_ref  # sets TRITON_INTERPRET first

from megatron_kd.loss import fused  # noqa: E402
from megatron_kd.loss.logits import anchor_columns  # noqa: E402
from megatron_kd.kernels import gemm  # noqa: E402
from megatron_kd.kernels.cols import anchor_logits, col_sweep  # noqa: E402
from reference import make_inputs  # noqa: E402

ANCH = dict(TUNE, logits="anchored")


@pytest.fixture
def redone(monkeypatch):
    """Rows sent through the fp32 redo, per call of fused._redo_rows."""
    seen = []
    orig = fused._redo_rows

    def spy(rows, *a, **k):
        seen.append(rows.numel())
        return orig(rows, *a, **k)
    monkeypatch.setattr(fused, "_redo_rows", spy)
    return seen


def bf16_inputs(scale, seed=7, n=(37,), V=300, H=24, K=9):
    inp = make_inputs(n_shape=n, V=V, H=H, K=K, dtype=torch.float32, seed=seed)
    inp["hidden"] = inp["hidden"].bfloat16()
    inp["weight"] = (inp["weight"] * scale).bfloat16()
    return inp


@pytest.mark.parametrize("scale,expect", [(0.25, "none"), (1.0, "some"), (6.0, "all")])
@pytest.mark.parametrize("kw", [dict(), dict(ce_weight=0.5), dict(temperature=0.7), dict(reduction="sum"),
                                dict(divergence="reverse_kl"), dict(divergence="jsd", ce_weight=0.5)],
                         ids=["kl", "ce", "T0.7", "sum", "rkl", "jsd"])
def test_anchored_matches_reference(redone, scale, expect, kw):
    inp = bf16_inputs(scale)
    got = run_fused(inp, 1.0, ANCH, **kw)
    want = run_ref(inp, 1.0, **kw)
    errs = [rel(a, b) for a, b in zip(got, want)]
    assert errs[0] <= 1e-3 and max(errs[1:]) <= 2e-2, errs
    n = sum(redone)
    counted = int((inp["loss_mask"] > 0).sum()) if inp["loss_mask"] is not None else 37
    assert {"none": n == 0, "some": 0 < n < 37, "all": n >= counted}[expect], (n, expect)


def test_anchored_agrees_with_fp32_logits():
    """Same bf16 operands: anchored and fp32 logits differ by bf16 rounding of y only."""
    inp = bf16_inputs(0.5, seed=3, n=(5, 11), V=517, H=40, K=7)
    a = run_fused(inp, 1.0, ANCH, ce_weight=0.3)
    b = run_fused(inp, 1.0, dict(TUNE, logits="fp32"), ce_weight=0.3)
    assert rel(a[0], b[0]) < 1e-3 and rel(a[1], b[1]) < 2e-2 and rel(a[2], b[2]) < 2e-2


@pytest.mark.parametrize("gout", [1.0, 0.25])
def test_anchored_main_grad(monkeypatch, gout):
    """Weight gradient straight into an fp32 main_grad, flagged rows included (scale 1.0 flags some)."""
    inp = bf16_inputs(1.0, seed=5)
    ref = run_ref(inp, gout)
    h = inp["hidden"].to(DEV).requires_grad_(True)
    w = inp["weight"].to(DEV).requires_grad_(True)
    w.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32, device=DEV)
    from megatron_kd import topk_kl_loss
    import megatron_kd.loss.api as api
    monkeypatch.setattr(api, "fused_available", lambda: True, raising=False)
    loss = topk_kl_loss(h, w, inp["ids"].to(DEV), inp["logp"].float().to(DEV), labels=inp["labels"].to(DEV),
                        loss_mask=inp["loss_mask"].to(DEV), impl="fused")
    (loss * gout).backward()
    assert rel(loss.detach().cpu(), ref[0]) < 1e-3
    assert rel(h.grad.cpu(), ref[1]) < 2e-2
    assert rel((w.main_grad - 0.5).cpu(), ref[2]) < 2e-2


@pytest.mark.parametrize("S,V,T", [(1, 5, 1.0), (37, 300, 0.7), (70, 129, 2.0)])
def test_col_sweep_in_place(S, V, T):
    g = torch.Generator().manual_seed(S)
    y = (torch.randn(V, S, generator=g) * 3).bfloat16()
    y[torch.rand(V, S, generator=g) < 0.05] = float("-inf")  # masked slot entries
    want_e = torch.exp(y.double() / T)
    yd = y.clone().to(DEV)
    s, m = col_sweep(yd, T)
    assert torch.allclose(yd.double().cpu(), want_e.bfloat16().double(), rtol=1e-2, atol=0)
    assert torch.allclose(s.double().cpu(), want_e.sum(0), rtol=1e-5)
    assert torch.equal(m.cpu(), y.float().amax(0))


def test_bias_gemm_rounds_once():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(33, 16, generator=g).bfloat16().to(DEV)
    h = torch.randn(7, 16, generator=g).bfloat16().to(DEV)
    b = torch.randn(7, generator=g).bfloat16().to(DEV) * 40
    out = torch.empty(33, 7, dtype=torch.bfloat16, device=DEV)
    gemm.mm_bias_t_into(w, h, b, out)
    want = (w.double() @ h.double().t() + b.double()).bfloat16()
    assert (out.double() - want.double()).abs().max() <= want.double().abs().max() * 2 ** -8


def test_anchors_skip_empty_slots():
    h = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], device=DEV).bfloat16()
    w = torch.tensor([[2.0, 0.0], [0.0, 3.0], [5.0, 5.0]], device=DEV).bfloat16()
    idx = torch.tensor([[0, -1], [-1, -1], [1, 2]], dtype=torch.int32, device=DEV)
    assert anchor_logits(h, w, idx).tolist() == [2.0, 0.0, 10.0]
    assert anchor_columns(9, 10) == [0, 1, 2, 9] and anchor_columns(2, 2) == [0, 1]


def test_anchored_rows_budget():
    from megatron_kd.loss.chunks import anchored_rows
    assert anchored_rows(128256, 3072, 0) == 2688  # <= 0.9 H, a multiple of 128: E <= 0.9 |W| in bf16
    assert anchored_rows(201088, 2880, 0) == 2560
    assert anchored_rows(1000, 64, 768 << 20) == (768 << 20) // 2000 // 128 * 128
    assert anchored_rows(1000, 64, 200_000) == 96  # below 128 rows: a multiple of 16
    assert anchored_rows(10 ** 9, 8, 0) == 16


def test_anchored_non_contiguous_hidden():
    """hidden as a strided view (e.g. [s, b, h] transposed before flattening) gives the same result."""
    inp = bf16_inputs(0.5, seed=2, n=(6, 5), V=200, H=16, K=5)
    base = run_fused(inp, 1.0, ANCH)
    inp2 = dict(inp)
    inp2["hidden"] = inp["hidden"].transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    other = run_fused(inp2, 1.0, ANCH)
    assert all(rel(a, b) < 1e-6 for a, b in zip(base, other))


def test_anchored_tiny_temperature(redone):
    """At T = 0.02 the bound on y / T (the sweep clamps at 80) flags rows that TAU alone would keep."""
    inp = bf16_inputs(0.25)
    got = run_fused(inp, 1.0, ANCH, temperature=0.02)
    want = run_ref(inp, 1.0, temperature=0.02)
    errs = [rel(a, b) for a, b in zip(got, want)]
    assert errs[0] <= 1e-3 and max(errs[1:]) <= 2e-2, errs
    assert sum(redone) > 0


# ops that synchronize the host with a CUDA device: scalar reads, nonzero, and Python values turned into
# tensors (copied host-to-device from pageable memory)
_SYNC_OPS = ("_local_scalar_dense", "nonzero", "lift_fresh", "is_nonzero", "item")


def _sync_ops(fn):
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(k in func.name() for k in _SYNC_OPS):
                seen.append(func.name())
            return func(*args, **(kwargs or {}))
    with Spy():
        fn()
    return seen


@pytest.mark.parametrize("logits", ["anchored", "fp32"])
@pytest.mark.parametrize("ce", [0.0, 0.5])
def test_anchored_syncs_do_not_grow_with_chunks(ce, logits):
    """The anchored path syncs once per call (the redo's nonzero), never per chunk: a per-chunk sync idles the
    GPU while the host queues the next chunk (idx[:, list] did, 11 times per call at N=32768)."""
    inp = bf16_inputs(0.25, n=(96,))
    run_fused(inp, 1.0, dict(ANCH, logits=logits), ce_weight=ce)  # fill the kernels' cached constants first
    counts = []
    for sup in (96, 16):  # one chunk, six chunks
        tune = dict(ANCH, super_rows=sup, sub_rows=8, logits=logits)
        counts.append(len(_sync_ops(lambda: run_fused(inp, 1.0, tune, ce_weight=ce))))
    assert counts[0] == counts[1], counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_anchored_host_syncs():
    """torch's own sync detector: a warm call of 8 chunks syncs as often as one of a single chunk."""
    import warnings
    inp = bf16_inputs(0.25, n=(1024,), V=4096, H=256, K=16)
    counts = []
    for sup in (1024, 128):
        tune = dict(logits="anchored", super_rows=sup)
        run_fused(inp, 1.0, tune)  # compile and cache first
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run_fused(inp, 1.0, tune)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    assert counts[0] == counts[1], counts
