"""impl="fused" (Triton + cuBLAS) against the independent float64 reference.

Without CUDA the Triton kernels run on CPU tensors under TRITON_INTERPRET=1 (set below, before triton is
imported); with CUDA the same small cases run compiled on the GPU, plus the @gpu cases at larger sizes.
Small settings (FusedSettings sub_rows / super_rows, Triton tile) make every size uneven: several sub-chunks per
super-chunk, a partial last chunk, a partial last vocabulary tile.
"""
import pytest
import torch

from fused_harness import CUDA, DEV, TUNE, _dev, check, gpu, rel, run_fused, run_ref  # sets TRITON_INTERPRET first
import torch.distributed as dist  # noqa: E402
from megatron_kd import topk_kl_loss  # noqa: E402
from megatron_kd.loss import FusedSettings, chunk_plan, fused  # noqa: E402
from megatron_kd.loss.fused import fused_topk_kl  # noqa: E402
from megatron_kd.kernels.rows import row_sweep  # noqa: E402
from megatron_kd.loss.inputs import check_and_flatten  # noqa: E402
from megatron_kd.loss.options import LossOptions  # noqa: E402
from megatron_kd.parallel.vocab import VocabShard  # noqa: E402
from reference import make_inputs, reference_loss  # noqa: E402


# (tail, temperature, ce_weight, reduction); at TP=1 fp64 takes the one-sweep path for tail "none" without CE at
# T != 1 and the two-pass path otherwise; the two-pass path at tail "none" is checked at TP=2
# (test_two_pass_tail_none_two_ranks).
CASES = [(tail, T, ce, red)
         for tail in ("none", "renormalize", "bucket")
         for (T, ce, red) in ((1.0, 0.0, "mean"), (1.0, 0.5, "sum"), (2.0, 0.5, "mean"), (0.7, 0.0, "sum"))]


@pytest.mark.parametrize("tail,T,ce,red", CASES)
def test_fp64_matches_reference(tail, T, ce, red):
    inp = make_inputs(n_shape=(37,), V=300, H=16, K=5, seed=hash((tail, T, red)) % 997)
    check(inp, 1e-9, tail=tail, temperature=T, ce_weight=ce, kl_weight=0.8, reduction=red)


# reverse KL and JSD; (T, ce) = (1.7, 0.5) is CE at T != 1: the two-pass path, also at tail none
DIV_CASES = [(div, tail, T, ce) for div in ("reverse_kl", "jsd") for tail in ("none", "renormalize", "bucket")
             for (T, ce) in ((1.0, 0.5), (1.7, 0.0), (1.7, 0.5))]


@pytest.mark.parametrize("div,tail,T,ce", DIV_CASES)
def test_fp64_divergences_match_reference(div, tail, T, ce):
    inp = make_inputs(n_shape=(37,), V=300, H=16, K=5, seed=hash((div, tail, T)) % 997)
    check(inp, 1e-9, tail=tail, temperature=T, ce_weight=ce, divergence=div, jsd_beta=0.3)


@pytest.mark.parametrize("T", [1.0, 1.4], ids=["one-sweep", "two-pass"])
@pytest.mark.parametrize("div", ["forward_kl", "reverse_kl"])
def test_fused_monitor_is_the_bucket_kl(div, T):
    inp = _dev(make_inputs(n_shape=(29,), V=200, H=8, K=6, seed=4))
    opts = LossOptions(impl="fused", divergence=div, ce_weight=0.3, temperature=T, monitor=True)
    shard = VocabShard.build(inp["weight"].shape[0])
    hh, t, _ = check_and_flatten(inp["hidden"], inp["weight"], inp["ids"], inp["logp"], inp["labels"],
                                 inp["loss_mask"], opts, vocab_size=shard.valid_size)
    m = {}
    fused_topk_kl(hh, inp["weight"].clone().requires_grad_(True), t, opts, shard, True, FusedSettings(**TUNE),
                  metrics=m)
    ref = reference_loss(inp["hidden"].cpu(), inp["weight"].cpu(), inp["ids"].cpu(), inp["logp"].cpu(),
                         inp["labels"].cpu(), inp["loss_mask"].cpu(), temperature=T, monitor=True)
    assert rel(m["kl_bucket"].cpu(), ref) <= 1e-9


def test_no_float_scalars_reach_the_kernels(monkeypatch):
    """A compiled kernel types a Python float argument as fp32 (the interpreter keeps float64), so 1/T by
    value broke the fp64 bar on the GPU at T=0.7 only. The scalars now travel as a tensor in the
    accumulation dtype; this guards that no float is passed by value again."""
    from megatron_kd.kernels import rows
    seen = []
    real = rows._launch

    def spy(raw, tuned, grid, block, *args, **kw):
        seen.extend(type(a).__name__ for a in list(args) + list(kw.values()) if isinstance(a, float))
        return real(raw, tuned, grid, block, *args, **kw)
    monkeypatch.setattr(rows, "_launch", spy)
    inp = make_inputs(n_shape=(13,), V=90, H=8, K=4, seed=11)
    check(inp, 1e-9, temperature=0.7, ce_weight=0.5, tail="bucket")
    check(inp, 1e-9, tail="renormalize", temperature=0.7)  # the two-pass path
    assert not seen
    p = rows._params(torch.device(DEV), torch.float64, 0.7, 20.0)
    assert p.dtype == torch.float64 and p[0].item() == 1.0 / 0.7  # exact in fp64, not fp32-rounded


def test_fused_settings_refuse_bad_values():
    """FusedSettings is checked once, with the fix in the message; topk_kl_loss takes nothing else."""
    for bad, match in ((dict(logits="bf16"), "use one of"), (dict(logits="fp8"), "use one of"),
                       (dict(z_mib=-1), ">= 0 MiB"), (dict(super_rows=0), "positive")):
        with pytest.raises(ValueError, match=match):
            FusedSettings(**bad)
    inp = _dev(make_inputs(n_shape=(5,), V=40, H=8, K=4, seed=1))
    with pytest.raises(ValueError, match="FusedSettings"):
        topk_kl_loss(inp["hidden"], inp["weight"], inp["ids"], inp["logp"], impl="fused",
                     fused_settings=dict(logits="fp32"))


def test_reduction_none_and_grad_output():
    inp = make_inputs(n_shape=(5, 7), V=60, H=8, K=4, seed=3)
    gout = torch.linspace(0.5, 1.5, 35, dtype=torch.float64).reshape(5, 7)
    check(inp, 1e-9, gout=gout, tail="bucket", ce_weight=0.3, reduction="none")
    check(inp, 1e-9, gout=torch.tensor(0.37, dtype=torch.float64), tail="none")  # scalar upstream grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2), (torch.float16, 2e-2)])
@pytest.mark.parametrize("tail", ["none", "bucket"])  # bucket: the two-pass path
def test_low_precision_inputs(dtype, tol, tail):
    inp = make_inputs(n_shape=(37,), V=300, H=24, K=9, dtype=torch.float32, seed=7)
    inp["hidden"], inp["weight"] = inp["hidden"].to(dtype), inp["weight"].to(dtype)
    check(inp, tol, tail=tail, ce_weight=0.5)  # reference uses the same rounded operands


@pytest.mark.parametrize("tail", ["none", "renormalize"])
def test_duplicate_ids_are_refused(tail):
    """A top-K lists each id once: one id in two slots is a corrupt cache, refused before any loss is computed."""
    inp = make_inputs(n_shape=(29,), V=200, H=12, K=6, seed=5, empty_frac=0.0)
    ids = inp["ids"].clone()
    ids[::2, 3] = ids[::2, 1]            # the same id in two slots
    with pytest.raises(ValueError, match="topk_ids holds one id twice"):
        topk_kl_loss(inp["hidden"], inp["weight"], ids, inp["logp"], labels=inp["labels"], tail=tail,
                     ce_weight=0.6, impl="fused")


def test_anchor_resweep():
    """A column far above the anchor (first tile, slot logits) forces the second sweep of that row."""
    inp = make_inputs(n_shape=(16,), V=300, H=16, K=5, seed=9)
    inp["weight"][290] = inp["hidden"][3] * 60.0  # row 3: logit ~ 60 |h|^2 in the last tile
    inp["ids"][3] = torch.tensor([0, 1, 2, 3, 4])
    inp["logp"][3] = torch.tensor([0.3, 0.2, 0.1, 0.1, 0.1]).log()
    check(inp, 1e-9, ce_weight=0.4)
    z = (inp["hidden"] @ inp["weight"].t()).to(DEV)
    zg = torch.full((16, 1), float("-inf"), dtype=z.dtype, device=DEV)  # no slots
    e = torch.empty_like(z)
    stat = row_sweep(z, e, zg, 1.0, False, 20.0, block=128)
    assert stat[3, 0].item() == pytest.approx(z[3].max().item())  # re-anchored at the row max
    assert torch.allclose(e[3], torch.exp(z[3] - z[3].max()))


@pytest.mark.skipif(CUDA, reason="on CUDA the real autotuner runs in every other test")
def test_autotuned_launch_binds(monkeypatch):
    """The GPU path launches through triton.autotune; with one config it skips benchmarking, so the
    interpreter can check that arguments and the BLOCK/num_warps config bind as on the GPU."""
    import triton
    from megatron_kd.kernels import rows
    one = [triton.Config({"BLOCK": 64}, num_warps=4)]
    monkeypatch.setattr(rows, "_sweep_tuned", triton.autotune(one, key=["V", "WRITE_E", "NEED_S1", "ACC"])(
        rows._sweep_kernel))
    monkeypatch.setattr(rows, "_grad_tuned", triton.autotune(one, key=["V", "NEED_B", "ACC"])(rows._grad_kernel))
    monkeypatch.setattr(rows, "INTERPRET", False)
    inp = make_inputs(n_shape=(11,), V=150, H=8, K=4, seed=12)
    check(inp, 1e-9, tune=dict(sub_rows=4, super_rows=8), ce_weight=0.5)
    check(inp, 1e-9, tune=dict(sub_rows=4, super_rows=8), tail="bucket", ce_weight=0.5, temperature=1.7)


def test_nothing_counted_and_empty_rows():
    inp = make_inputs(n_shape=(12,), V=50, H=8, K=4, seed=2)
    inp["ids"][:4] = -1                  # rows without teacher slots
    inp["loss_mask"] = torch.zeros(12, dtype=torch.float64)
    loss, gh, gw = run_fused(inp)
    assert loss.item() == 0.0 and torch.all(gh == 0) and torch.all(gw == 0)
    inp["loss_mask"] = None
    check(inp, 1e-9, tail="bucket", ce_weight=0.2)


def test_padded_vocab_and_public_api():
    """topk_kl_loss(impl="fused"): leading dims, non-contiguous hidden, padded vocabulary rows."""
    inp = make_inputs(n_shape=(4, 9), V=130, H=8, K=5, seed=4)
    inp["ids"] = inp["ids"].masked_fill(inp["ids"] >= 120, -1)
    inp["labels"] = inp["labels"].masked_fill(inp["labels"] >= 120, 0)
    d = _dev(inp)
    h = d["hidden"].transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(True)
    w = d["weight"].clone().requires_grad_(True)
    out = topk_kl_loss(h, w, d["ids"], d["logp"], labels=d["labels"], loss_mask=d["loss_mask"], impl="fused",
                       chunk_size=7, tail="bucket", ce_weight=0.5, temperature=1.5, valid_vocab_size=120)
    out.backward()
    ref, rh, rw = run_ref(inp, tail="bucket", ce_weight=0.5, temperature=1.5, valid_vocab_size=120)
    assert max(rel(out.cpu(), ref), rel(h.grad.cpu(), rh), rel(w.grad.cpu(), rw)) <= 1e-9
    assert torch.all(w.grad[120:] == 0)


class _Counter:
    def __init__(self, monkeypatch):
        self.n = 0
        real = fused.run

        def counted(*a, **k):
            self.n += 1
            return real(*a, **k)
        monkeypatch.setattr(fused, "run", counted)


@pytest.mark.parametrize("gout,expect,megatron_flag", [(1.0, None, False), (0.25, None, False), (0.25, 0.25, True)])
def test_main_grad_accumulation(monkeypatch, gout, expect, megatron_flag):
    inp = _dev(make_inputs(n_shape=(21,), V=90, H=8, K=4, seed=6))
    h = inp["hidden"].clone().requires_grad_(True)
    w = inp["weight"].clone().requires_grad_(True)
    m0 = torch.randn(w.shape, dtype=torch.float64, device=DEV)
    w.main_grad = m0.clone()
    if megatron_flag:
        w.grad_added_to_main_grad = False
    calls = _Counter(monkeypatch)
    out = topk_kl_loss(h, w, inp["ids"], inp["logp"], labels=inp["labels"], loss_mask=inp["loss_mask"],
                       impl="fused", chunk_size=8, ce_weight=0.5, grad_scale=expect or 1.0)
    (out * gout).backward()
    ref, rh, rw = run_ref({k: (v.cpu() if torch.is_tensor(v) else v) for k, v in inp.items()}, gout, ce_weight=0.5)
    assert rel((w.main_grad - m0).cpu(), rw) <= 1e-9
    assert rel(h.grad.cpu(), rh) <= 1e-9
    assert calls.n == (2 if gout != (expect or 1.0) else 1)  # a second pass only when the guess was wrong
    if megatron_flag:
        assert w.grad_added_to_main_grad and w.grad is not None
    else:
        assert w.grad is None


@pytest.mark.parametrize("gout", [1.0, 0.25])
def test_bf16_main_grad_gets_the_fp32_result_once(monkeypatch, gout):
    """A bf16 main_grad (Megatron DDP without grad_reduce_in_fp32, train.optimizer=lean_adam): the weight
    gradient is accumulated in fp32 and added once, no bf16 copy returned; a wrong grad_output guess re-adds."""
    inp = _dev(make_inputs(n_shape=(21,), V=90, H=8, K=4, seed=16))
    h = inp["hidden"].clone().requires_grad_(True)
    w = inp["weight"].clone().requires_grad_(True)
    w.main_grad = torch.zeros(w.shape, dtype=torch.bfloat16, device=DEV)
    calls = _Counter(monkeypatch)
    out = topk_kl_loss(h, w, inp["ids"], inp["logp"], labels=inp["labels"], loss_mask=inp["loss_mask"],
                       impl="fused", chunk_size=8)
    (out * gout).backward()
    ref, rh, rw = run_ref({k: (v.cpu() if torch.is_tensor(v) else v) for k, v in inp.items()}, gout)
    # one bf16 rounding; with gout != 1 the first add holds 1/gout = 4x the result, so its rounding counts 4x
    assert rel(w.main_grad.double().cpu(), rw) <= 2 ** -8 * (1 if gout == 1.0 else 1 + 2 / gout)
    assert rel(h.grad.cpu(), rh) <= 1e-9
    assert w.grad is None and calls.n == (2 if gout != 1.0 else 1)


def test_no_grad_forward_only():
    inp = make_inputs(n_shape=(19,), V=80, H=8, K=4, seed=8)
    d = _dev(inp)
    with torch.no_grad():
        out = topk_kl_loss(d["hidden"], d["weight"], d["ids"], d["logp"], labels=d["labels"], impl="fused",
                           chunk_size=8, ce_weight=0.3, tail="renormalize")
    ref = reference_loss(inp["hidden"], inp["weight"], inp["ids"], inp["logp"], inp["labels"], ce_weight=0.3,
                         tail="renormalize")
    assert rel(out.cpu(), ref) <= 1e-9


def test_plan_chunks_budgets():
    fs = FusedSettings()
    z, e = fs.z_mib << 20, fs.e_mib << 20
    p = chunk_plan(128256, 3072, dtype=torch.float32)
    c, s = p.sub_rows, p.super_rows
    assert p.path == "fp32_logits" and s % c == 0 and c * 128256 * 4 <= z and s * 128256 * 2 <= e
    p = chunk_plan(201088, 2880, tp=2)
    assert p.path == "two_pass" and p.sub_rows == p.super_rows and p.sub_rows * 201088 * 6 <= z + e
    assert chunk_plan(50, 8, dtype=torch.float32, opts=LossOptions(chunk_size=7)).super_rows == 7
    p = chunk_plan(128256, 3072)
    assert p.path == "anchored" and p.sub_rows == p.super_rows == 2688
    p = chunk_plan(128256, 3072, settings=FusedSettings(super_rows=96), opts=LossOptions(chunk_size=7))
    assert p.super_rows == 96  # settings before LossOptions.chunk_size


@pytest.mark.parametrize("kw,path", [
    (dict(), "anchored"), (dict(settings=FusedSettings(logits="fp32")), "fp32_logits"),
    (dict(dtype=torch.float32), "fp32_logits"), (dict(dtype=torch.float64), "fp32_logits"),
    (dict(dtype=torch.float16), "two_pass"), (dict(tp=2), "two_pass"), (dict(needs_grad=False), "two_pass"),
    (dict(opts=LossOptions(tail="bucket")), "two_pass"),
    (dict(opts=LossOptions(ce_weight=0.5, temperature=2.0)), "two_pass"),
    (dict(opts=LossOptions(ce_weight=0.5)), "anchored")])
def test_chunk_plan_paths(kw, path):
    """The three loops production runs, and what selects each (the planner reads the same function)."""
    assert chunk_plan(1000, 64, **kw).path == path


def test_run_follows_the_plan(monkeypatch):
    """fused.run takes the loop chunk_plan names: anchored logits only on the anchored path."""
    made = []
    for name in ("AnchoredLogits", "Fp32Logits"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _r=real, _n=name, **k: made.append(_n) or _r(*a, **k))
    inp = make_inputs(n_shape=(12,), V=60, H=8, K=4, dtype=torch.float32, seed=3)
    bf = dict(inp, hidden=inp["hidden"].bfloat16(), weight=inp["weight"].bfloat16())
    run_fused(bf)
    run_fused(bf, tune=dict(TUNE, logits="fp32"))
    run_fused(inp, tail="bucket")
    assert made == ["AnchoredLogits", "Fp32Logits", "Fp32Logits"]


@pytest.mark.skipif(CUDA, reason="CPU structural check (interpreter)")
def test_no_n_by_v_tensor():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.set_.source_Storage, torch.ops.aten.copy_.default):
                return out  # the interpreter's byte copies of kernel arguments, no new tensors of ours
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.largest = max(Largest.largest, t.numel())
            return out

    n, v = 192, 96
    inp = make_inputs(n_shape=(n,), V=v, H=4, K=4, dtype=torch.float32, seed=1)
    with Largest():
        run_fused(inp, tune=dict(sub_rows=16, super_rows=32, block=32))
    assert Largest.largest <= 32 * v < n * v


# ---------------------------------------------------------------- tensor parallel (gloo, 2 ranks)
TP_CASES = [  # tail, temperature, ce, sequence parallel, padded vocab, uneven shards
    ("none", 1.0, 0.0, False, False, False),
    ("bucket", 2.0, 0.5, True, True, True),
    ("renormalize", 1.0, 0.5, False, True, False),
]


def _tp_worker(rank, world):
    for case_no, (tail, T, ce, sp, padded, uneven) in enumerate(TP_CASES):
        s, b, V = 4 * world, 3, 13 * world
        inp = make_inputs(n_shape=(s, b), V=V, H=8, K=5, seed=case_no)
        valid = V - 3 if padded else None
        if padded:
            inp["ids"] = inp["ids"].masked_fill(inp["ids"] >= V - 3, -1)
            inp["labels"] = inp["labels"].masked_fill(inp["labels"] >= V - 3, 0)
        cuts = [0, 15, V] if uneven else [0, 13, V]
        lo, hi = cuts[rank], cuts[rank + 1]
        w = inp["weight"][lo:hi].clone().requires_grad_(True)
        n_loc = s // world
        h = (inp["hidden"][rank * n_loc:(rank + 1) * n_loc] if sp else inp["hidden"]).clone().requires_grad_(True)
        kw = dict(tail=tail, temperature=T, ce_weight=ce)
        out = topk_kl_loss(h, w, inp["ids"], inp["logp"], labels=inp["labels"], loss_mask=inp["loss_mask"],
                           impl="fused", chunk_size=5, tp_group=dist.group.WORLD, sequence_parallel=sp,
                           vocab_start_index=lo if uneven else None, valid_vocab_size=valid, **kw)
        (out * 1.3).backward()
        ref, rh, rw = run_ref(inp, 1.3, valid_vocab_size=valid, **kw)
        rh = rh[rank * n_loc:(rank + 1) * n_loc] if sp else rh
        errs = rel(out, ref), rel(h.grad, rh), rel(w.grad, rw[lo:hi])
        assert max(errs) <= 1e-9, (rank, TP_CASES[case_no], errs)


@pytest.mark.skipif(CUDA, reason="gloo + interpreter check; NCCL runs belong to the GPU benchmark")
def test_tensor_parallel_two_ranks():
    from dist_utils import run_ranks
    run_ranks(2, _tp_worker)


TWO_PASS_NONE = [(1.0, 0.0, "mean", False), (1.0, 0.5, "sum", True), (0.7, 0.0, "sum", False)]  # T, ce, red, dup ids


def _two_pass_worker(rank, world):
    """Tail "none" at TP > 1 runs the two-pass loop (at TP=1 it takes the one-sweep path): fp64 against the reference,
    with a label among the teacher's ids in one case."""
    for case_no, (T, ce, red, dup) in enumerate(TWO_PASS_NONE):
        V = 11 * world
        inp = make_inputs(n_shape=(29,), V=V, H=12, K=6, seed=40 + case_no, empty_frac=0.0 if dup else 0.15)
        if dup:  # a label among the teacher's ids
            inp["labels"] = inp["labels"].clone()
            inp["labels"][::3] = inp["ids"][::3, 0]
        lo, hi = rank * V // world, (rank + 1) * V // world
        w = inp["weight"][lo:hi].clone().requires_grad_(True)
        h = inp["hidden"].clone().requires_grad_(True)
        kw = dict(temperature=T, ce_weight=ce, kl_weight=0.8, reduction=red)
        out = topk_kl_loss(h, w, inp["ids"], inp["logp"], labels=inp["labels"], loss_mask=inp["loss_mask"],
                           impl="fused", chunk_size=8, tp_group=dist.group.WORLD, **kw)
        out.backward()
        ref, rh, rw = run_ref(inp, 1.0, **kw)
        errs = rel(out, ref), rel(h.grad, rh), rel(w.grad, rw[lo:hi])
        assert max(errs) <= 1e-9, (rank, TWO_PASS_NONE[case_no], errs)


@pytest.mark.skipif(CUDA, reason="gloo + interpreter check")
def test_two_pass_tail_none_two_ranks():
    from dist_utils import run_ranks
    run_ranks(2, _two_pass_worker)


# ---------------------------------------------------------------- GPU only
@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tail,ce,T,logits", [("none", 0.0, 1.0, "anchored"), ("none", 0.0, 1.0, "fp32"),
                                              ("none", 0.5, 1.0, "anchored"), ("bucket", 0.5, 2.0, "anchored")])
def test_gpu_bf16_against_fp64(tail, ce, T, logits):
    g = torch.Generator(device="cuda").manual_seed(0)
    N, V, H, K = 2048, 32000, 1024, 64
    h = (torch.randn(N, H, device="cuda", generator=g) * 0.5).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5 * 4).bfloat16()
    tl = torch.randn(N, V, device="cuda", generator=g) * 3
    logp, ids = torch.log_softmax(tl, -1).topk(K, -1)
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    del tl
    inp = dict(hidden=h, weight=w, ids=ids, logp=logp, labels=labels, loss_mask=None)
    got = run_fused(inp, tune=dict(sub_rows=256, super_rows=1024, logits=logits), tail=tail, ce_weight=ce,
                    temperature=T)
    hh = h.double().requires_grad_(True)
    ww = w.double().requires_grad_(True)
    ref = reference_loss(hh, ww, ids, logp.double(), labels, None, tail=tail, ce_weight=ce, temperature=T)
    ref.backward()
    assert rel(got[0], ref.cpu()) <= 1e-3
    assert rel(got[1], hh.grad.cpu()) <= 1e-2 and rel(got[2], ww.grad.cpu()) <= 1e-2
