"""train.optimizer=lean_adam: the bf16 weight + int16 remainder is the exact fp32 master; one step equals AdamW
in float64 on fresh random inputs (torch path and the Triton kernel in interpreter mode); the optimizer tracks
torch's AdamW on fp32 weights; its state survives a state_dict round trip with its dtypes; a run resumed from a
checkpoint reproduces the uninterrupted run; bad settings name the fix."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`: the kernel runs on CPU

from megatron_kd.kernels import adam  # noqa: E402
from megatron_kd.kernels.adam import adamw_step_, join_master, split_master  # noqa: E402
from megatron_kd.optim.lean_adam import LeanAdamW  # noqa: E402


def split(x):
    w = torch.empty(x.shape, dtype=torch.bfloat16)
    r = torch.empty(x.shape, dtype=torch.int16)
    split_master(x, w, r)
    return w, r


def test_weight_and_remainder_are_the_exact_master():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20000, generator=g) * torch.logspace(-35, 35, 20000).float()
    x[:6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.3e38, -1e-44])
    w, r = split(x)
    assert torch.equal(join_master(w, r).view(torch.int32), x.view(torch.int32))
    finite = x.abs() < 3e38
    assert torch.equal(w[finite], x[finite].to(torch.bfloat16))  # the weight is the master rounded to nearest


def reference(x, g, m, v, lr, b1, b2, eps, wd, step):
    x, g, m, v = (t.double() for t in (x, g, m, v))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    x = x * (1 - lr * wd) - lr * (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps)
    return x, m, v


@pytest.mark.parametrize("moments", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                     (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("kernel", [False, True])
def test_one_step_matches_float64_adamw(moments, kernel, monkeypatch):
    dev = torch.device("cuda" if kernel and torch.cuda.is_available() else "cpu")
    if kernel:
        pytest.importorskip("triton")
        assert adam.use_triton(torch.zeros(1, device=dev)), "the Triton kernel must run here (interpreter on CPU)"
    else:
        monkeypatch.setattr(adam, "use_triton", lambda t: False)
    gen = torch.Generator().manual_seed(7 + kernel)
    n = 3001  # not a multiple of the block
    x = torch.randn(n, generator=gen)
    w, r = split(x)
    x = join_master(w, r)
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    m = (torch.randn(n, generator=gen) * 0.1).to(moments[0])
    v = (torch.rand(n, generator=gen) * 0.01).to(moments[1])
    hp = dict(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, step=4)
    xr, mr, vr = reference(x, grad, m, v, **hp)
    w, r, grad, m, v = (t.to(dev) for t in (w, r, grad, m, v))
    adamw_step_(w, r, grad, m, v, lr=hp["lr"], beta1=hp["b1"], beta2=hp["b2"], eps=hp["eps"],
                weight_decay=hp["wd"], step=hp["step"], block=1024)
    w, r, m, v = (t.cpu() for t in (w, r, m, v))
    got = join_master(w, r).double()
    scale = x.double().abs() + (xr - x.double()).abs()  # the update itself carries fp32 rounding
    assert ((got - xr).abs() <= 5e-7 * scale).all()  # fp32 master: a few fp32 roundings
    tol = 2 ** -7 if moments[0] == torch.bfloat16 else 1e-6  # one bf16 ulp (the interpreter truncates)
    assert torch.allclose(m.double(), mr, rtol=tol, atol=1e-7)  # atol: cancellation in b1 m + (1-b1) g
    tol = 2 ** -7 if moments[1] == torch.bfloat16 else 1e-6
    assert torch.allclose(v.double(), vr, rtol=tol, atol=1e-10)
    assert torch.equal(w, join_master(w, r).to(torch.bfloat16))


def test_tracks_torch_adamw_on_fp32_weights():
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(64, 33, generator=gen)
    ref = torch.nn.Parameter(x0.clone())
    lean = torch.nn.Parameter(x0.to(torch.bfloat16))
    t_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    l_opt = LeanAdamW([lean], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, exp_avg_dtype="fp32")
    ref.data.copy_(lean.data.float())  # same starting master
    for _ in range(8):
        g = torch.randn(64, 33, generator=gen)
        ref.grad, lean.grad = g.clone(), g.to(torch.bfloat16)
        ref.grad.copy_(lean.grad.float())  # same gradients (lean gets bf16 grads from Megatron's DDP)
        t_opt.step()
        l_opt.step()
    master = join_master(lean.data, l_opt.state[lean]["master_rem"])
    assert torch.allclose(master, ref.data, rtol=1e-5, atol=1e-6)
    assert torch.equal(lean.data, master.to(torch.bfloat16))


def test_fp32_parameters_get_plain_adamw():
    """Norm weights left in fp32 (a model outside Float16Module) follow torch's AdamW."""
    gen = torch.Generator().manual_seed(9)
    a = torch.nn.Parameter(torch.randn(17, generator=gen))
    b = torch.nn.Parameter(a.data.clone())
    oa = LeanAdamW([a], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ob = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(4):
        a.grad = b.grad = torch.randn(17, generator=gen)
        oa.step()
        ob.step()
    assert "master_rem" not in oa.state[a] and oa.state[a]["exp_avg"].dtype == torch.float32
    assert torch.allclose(a.data, b.data, rtol=1e-6, atol=1e-7)


def test_state_dict_round_trip_keeps_dtypes_and_continues_exactly():
    gen = torch.Generator().manual_seed(5)
    a = torch.nn.Parameter(torch.randn(40, generator=gen).to(torch.bfloat16))
    b = torch.nn.Parameter(a.data.clone())
    oa, ob = LeanAdamW([a], lr=1e-2), LeanAdamW([b], lr=1e-2)
    grads = [torch.randn(40, generator=gen).to(torch.bfloat16) for _ in range(4)]
    for g in grads[:2]:
        a.grad = b.grad = g
        oa.step()
        ob.step()
    sd = oa.state_dict()
    fresh = torch.nn.Parameter(a.data.clone())
    oc = LeanAdamW([fresh], lr=1e-2)
    oc.load_state_dict(sd)
    st = oc.state[fresh]
    assert st["master_rem"].dtype == torch.int16 and st["exp_avg"].dtype == torch.bfloat16
    assert st["exp_avg_sq"].dtype == torch.float32 and oc.param_groups[0]["step"] == 2
    for g in grads[2:]:
        fresh.grad = b.grad = g
        oc.step()
        ob.step()
    assert torch.equal(fresh.data, b.data)
    assert torch.equal(oc.state[fresh]["master_rem"], ob.state[b]["master_rem"])


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="train.precision=bf16"):
        LeanAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))])
    with pytest.raises(ValueError, match="exp_avg_sq_dtype"):
        LeanAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], exp_avg_sq_dtype="fp16")
    w = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="remainder"):
        adamw_step_(w, torch.zeros(4, dtype=torch.int32), w, w, w, lr=1, beta1=0.9, beta2=0.9, eps=1e-8,
                    weight_decay=0, step=1)


def test_recipe_refuses_lean_adam_without_bf16():
    from megatron_kd.recipe.schema import RecipeError, to_recipe
    from megatron_kd.recipe.checks import check_recipe
    from megatron_kd.recipe.compose import compose
    r = to_recipe(compose("tiny_cpu", ["train.optimizer=lean_adam", "train.precision=fp32"]))
    with pytest.raises(RecipeError, match="set train.precision=bf16"):
        check_recipe(r, cuda=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU gloo harness (test_megatron_train); on GPUs the "
                    "device run resumes `megatron-kd train` with lean_adam instead")
def test_resumed_lean_adam_run_reproduces_the_uninterrupted_run(tmp_path):
    from train_harness import losses, train
    lean = ["kd=ce", "train.precision=bf16", "train.optimizer=lean_adam", "train.iters=5",
            "train.device=cpu"]  # CPU kernels are deterministic: exact equality holds
    train(tmp_path / "whole", *lean)
    train(tmp_path / "parts", *lean, "train.stop_at=2")
    train(tmp_path / "parts", *lean)
    whole, parts = losses(tmp_path / "whole"), losses(tmp_path / "parts")
    assert sorted(parts) == sorted(whole) == [1, 2, 3, 4, 5]
    assert whole[5]["loss"] < whole[1]["loss"]  # it trains
    for it in whole:
        assert parts[it]["loss"] == whole[it]["loss"], it  # exact: weights, remainders and moments restored


@pytest.mark.parametrize("pattern", [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFFFF8001, 0x7FC00000])
def test_nan_masters_stay_nan_weights(pattern):
    """GPUs return NaN as 0x7FFFFFFF, whose rounding carry would make the bf16 weight -0.0: a dead weight that
    keeps training quietly. Every NaN master must give a NaN weight."""
    bits = torch.tensor([pattern - (1 << 32) if pattern >= 1 << 31 else pattern], dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    assert torch.isnan(x).all()
    w, r = split(x)
    assert torch.isnan(w.float()).all() and torch.isnan(join_master(w, r)).all()


@pytest.mark.parametrize("kernel", [False, True])
def test_nan_gradient_gives_nan_weight_in_the_step(kernel, monkeypatch):
    dev = torch.device("cuda" if kernel and torch.cuda.is_available() else "cpu")
    if kernel:
        pytest.importorskip("triton")
    else:
        monkeypatch.setattr(adam, "use_triton", lambda t: False)
    w, r = split(torch.ones(8))
    g = torch.zeros(8, dtype=torch.bfloat16)
    g[3] = float("nan")
    m, v = torch.zeros(8), torch.zeros(8)
    w, r, g, m, v = (t.to(dev) for t in (w, r, g, m, v))
    adamw_step_(w, r, g, m, v, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)
    w = w.cpu().float()
    assert torch.isnan(w[3]) and torch.isfinite(w[torch.arange(8) != 3]).all()


def test_a_nonfinite_gradient_norm_skips_the_update(monkeypatch):
    """Megatron's FP32Optimizer never skips; ours does when the norm is NaN/inf (weights and moments untouched)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron_kd.optim.setup import _fp32_optimizer_class
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = _fp32_optimizer_class()(LeanAdamW([p], lr=0.1), OptimizerConfig(lr=0.1, clip_grad=1.0, bf16=True),
                                  lambda o, config=None: o.init_state())
    monkeypatch.setattr(opt, "get_grad_stats_parallel_group", lambda: None, raising=False)
    for name in ("get_main_grads_for_grad_norm", "get_grads_for_grad_norm"):
        monkeypatch.setattr(opt, name, lambda: [p.grad], raising=False)
    p.grad = torch.tensor([1.0, float("inf"), 0.0, 0.0], dtype=torch.bfloat16)
    ok, norm, _ = opt.step()
    assert not ok and not torch.isfinite(torch.tensor(norm)) and torch.equal(p.data, torch.ones(4, dtype=torch.bfloat16))
    p.grad = torch.tensor([1.0, 0.5, 0.0, 0.0], dtype=torch.bfloat16)
    ok, norm, _ = opt.step()  # the next finite step goes through
    assert ok and not torch.equal(p.data, torch.ones(4, dtype=torch.bfloat16))


@pytest.mark.parametrize("overrides,match", [
    (["parallel.ep=2"], "expert parallelism"),
    (["train.exp_avg_sq_dtype=bf16", "train.adam_beta2=0.999"], "exp_avg_sq_dtype=fp32"),
])
def test_recipe_refuses_unsafe_lean_adam_settings(overrides, match):
    from megatron_kd.recipe.schema import RecipeError, to_recipe
    from megatron_kd.recipe.checks import check_recipe
    from megatron_kd.recipe.compose import compose
    r = to_recipe(compose("tiny_cpu", ["train.optimizer=lean_adam", "train.precision=bf16", *overrides]))
    with pytest.raises(RecipeError, match=match):
        check_recipe(r, world_size=None, cuda=True)
