"""Quantized students (recipe section quant, NVIDIA ModelOpt): refused formats, the output layer left unquantized
for the fused loss, resume with the quantizers' state, TP."""
import contextlib

import pytest
import torch

from megatron_kd.recipe.checks import check_recipe
from megatron_kd.recipe.compose import compose
from megatron_kd.recipe.schema import RecipeError, to_recipe

from dist_utils import run_ranks
from train_harness import BASE, losses, train

pytest.importorskip("modelopt.torch.quantization")


def recipe(*overrides):
    return to_recipe(compose("tiny_cpu", [*BASE, *overrides]))


def test_a_format_this_machine_cannot_run_is_refused_naming_the_key(tmp_path, monkeypatch):
    with pytest.raises(RecipeError) as e:
        check_recipe(recipe("quant.format=nvfp4"), None, cuda=False)
    msg = str(e.value)
    assert msg.startswith("quant.format=nvfp4 needs a CUDA GPU") and "fp8" in msg and "\n" not in msg
    check_recipe(recipe("quant.format=nvfp4"), None, cuda=True)  # a GPU runs it
    with pytest.raises(RecipeError, match=r"^quant.format='fp4': use one of none, fp8"):
        check_recipe(recipe("quant.format=fp4"), None, cuda=False)
    with pytest.raises(RecipeError, match=r"^quant.calib_samples=0 must be >= 1"):
        check_recipe(recipe("quant.format=fp8", "quant.calib_samples=0"), None, cuda=False)
    with pytest.raises(RecipeError, match=r"^quant.format=fp8 with parallel.pp=2: .* set parallel.pp=1"):
        check_recipe(recipe("quant.format=fp8", "parallel.pp=2", "kd.build_cache=false"), None, cuda=True)
    with monkeypatch.context() as m:  # as where Transformer Engine imports
        m.setattr("megatron_kd.runtime.features.te_available", lambda: True)
        with pytest.raises(RecipeError, match=r"^quant.format=fp8 with model.fp8=hybrid: .* set model.fp8=null"):
            check_recipe(recipe("quant.format=fp8", "model.fp8=hybrid"), None, cuda=True)
    # before any work: no save directory is made
    with pytest.raises(RecipeError, match="quant.format=nvfp4"):
        train(tmp_path / "run", "kd=ce", "quant.format=nvfp4", "train.device=cpu")
    assert not (tmp_path / "run").exists()


@contextlib.contextmanager
def tiny_quantized(fmt):
    """A small GPT quantized as fmt, calibrated on random tokens, inside its process group: (recipe, model,
    tokens, position ids)."""
    from megatron_kd.models import quant
    from megatron_kd.models.builder import build_gpt
    from megatron_kd.runtime.dist import distributed
    r = recipe("model.hidden_size=128", "model.ffn_hidden_size=256", "model.make_vocab_size_divisible_by=8")
    torch.manual_seed(0)
    with distributed(r.parallel, 1, "cpu"):
        model = build_gpt(r.model, r.parallel, 250, 32, "fp32")
        tokens = torch.randint(0, 250, (2, 32))
        pos = torch.arange(32).expand(2, 32)
        quant.quantize(model, fmt, lambda m: m(tokens, pos, None))
        yield r, model, tokens, pos


@pytest.mark.parametrize("fmt", ["fp8", "int4_awq"])
def test_the_fused_loss_reads_the_output_layer_the_quantized_model_multiplies_by(fmt):
    """The loss takes hidden states and the output layer's weight; the quantized model's own logits (its output
    layer's forward, quantizers and all) must give the same CE, so the output layer must stay unquantized."""
    from megatron_kd.models import quant
    from megatron_kd.training.evaluate import _ce
    with tiny_quantized(fmt) as (r, model, tokens, pos):
        assert quant.enabled_quantizers(model) and not [n for n in quant.enabled_quantizers(model)
                                                        if "output_layer" in n or "embedding" in n]
        model.eval()
        with torch.no_grad():
            labels = torch.roll(tokens, -1, 1)
            logits = model(tokens, pos, None).double()[..., :250]  # [b, s, V]: the padded ids are no tokens
            ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
            got = _ce(model, {"tokens": tokens, "position_ids": pos, "labels": labels}, 250)  # [b, s]
        assert torch.allclose(got.double().flatten(), ref, rtol=1e-5, atol=1e-5)
        # and quantization is live: the unquantized model gives other logits
        with torch.no_grad(), quant_disabled(model):
            plain = model(tokens, pos, None).double()[..., :250]
        assert (plain - logits).abs().max() > 1e-4


class quant_disabled:
    def __init__(self, model):
        import modelopt.torch.quantization as mtq
        self.model, self.mtq = model, mtq

    def __enter__(self):
        self.mtq.disable_quantizer(self.model, "*")

    def __exit__(self, *exc):
        self.mtq.enable_quantizer(self.model, "*")
        self.mtq.disable_quantizer(self.model, "*output_layer*")


def test_resume_keeps_the_quantizer_state(tmp_path):
    """A run stopped and resumed gives the uninterrupted run's losses: the quantizers come back with their
    calibrated values (recalibrating on resume, or losing amax, changes every later step)."""
    q = ["kd=ce", "quant.format=int8", "quant.calib_samples=4", "train.iters=4"]
    train(tmp_path / "whole", *q)
    train(tmp_path / "parts", *q, "train.stop_at=2")
    train(tmp_path / "parts", *q)
    whole, parts = losses(tmp_path / "whole"), losses(tmp_path / "parts")
    assert sorted(parts) == sorted(whole) == [1, 2, 3, 4]
    for it in whole:
        assert parts[it]["loss"] == pytest.approx(whole[it]["loss"], rel=1e-6, abs=1e-7), it
    from megatron_kd.checkpoint.store import read_common
    from megatron_kd.models.quant import FORMAT_KEY, STATE_KEY
    common = read_common(str(tmp_path / "parts"))
    assert common[FORMAT_KEY] == "int8" and common[STATE_KEY]["modelopt_state_dict"]
    # quant.format=none on resume keeps the checkpoint's quantizers; another format is refused by name
    with pytest.raises(RecipeError, match=r"quant.format=fp8: the student loaded from .* is already quantized "
                                          r"as int8; set quant.format=int8"):
        train(tmp_path / "parts", "kd=ce", "quant.format=fp8", "quant.calib_samples=4", "train.iters=5")


def _tp_run(rank, world, save, fmt):
    train(save, "kd=ce", f"quant.format={fmt}", "quant.calib_samples=4", "train.iters=2", "parallel.tp=2")


@pytest.mark.slow
def test_a_quantized_student_trains_under_tp_as_on_one_rank(tmp_path):
    q = ["kd=ce", "quant.format=int8", "quant.calib_samples=4", "train.iters=2"]
    train(tmp_path / "tp1", *q)
    run_ranks(2, _tp_run, tmp_path / "tp2", "int8")
    one, two = losses(tmp_path / "tp1"), losses(tmp_path / "tp2")
    for it in (1, 2):
        assert two[it]["loss"] == pytest.approx(one[it]["loss"], rel=1e-5), it


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int8_wo", "int4_awq", "w4a8_awq"])
def test_the_planner_counts_the_quantizer_state_modelopt_makes(fmt):
    from megatron_kd.models import quant
    from megatron_kd.models.builder import build_gpt
    from megatron_kd.plan.memory import _linears, plan_memory, quantizer_bytes
    from megatron_kd.plan.recipe import from_recipe, shape_from_config
    from megatron_kd.plan.shapes import Layout
    from megatron_kd.runtime.dist import distributed
    r = recipe("model.hidden_size=128", "model.ffn_hidden_size=384", "model.num_layers=2",
               "model.make_vocab_size_divisible_by=8", f"quant.format={fmt}")
    with distributed(r.parallel, 1, "cpu"):
        model = build_gpt(r.model, r.parallel, 250, 32, "fp32")
        tokens = torch.randint(0, 250, (2, 32))
        quant.quantize(model, fmt, lambda m: m(tokens, torch.arange(32).expand(2, 32), None))
        measured = quant.quantizer_bytes(model)
    shape = shape_from_config(r.model, 250, 32)
    lins = [x for _ in range(2) for x in _linears(shape, Layout(), False)]
    assert quantizer_bytes(fmt, lins) == measured > 0
    rp = from_recipe(r)
    plan = plan_memory(rp.shape, rp.layout, rp.training_for(rp.layout))
    assert plan.get("quantizer state") == measured


@pytest.mark.parametrize("fmt", ["int4_awq", "fp8", "w4a8_awq"])
def test_the_folded_weights_give_the_quantized_models_logits_without_its_activation_quantizers(fmt):
    """What the export writes (quant.folded_state_dict) in a plain model of the same architecture multiplies by
    the quantized model's weights, AWQ's input scales folded in: its logits are the quantized model's with only
    the activation quantizers off (to fp32 rounding), which for a weight-only format are its logits."""
    from megatron_kd.models import quant
    from megatron_kd.models.builder import build_gpt
    with tiny_quantized(fmt) as (r, model, tokens, pos):
        model.eval()
        plain = build_gpt(r.model, r.parallel, 250, 32, "fp32").eval()
        plain.load_state_dict(quant.folded_state_dict(model), strict=True)
        assert not quant.is_quantized(plain)
        with torch.no_grad():
            fq = model(tokens, pos, None).double()
            got = plain(tokens, pos, None).double()
            acts = quant.activation_quantizers(model)
            for n in acts:
                model.get_submodule(n).disable()
            weights_only = model(tokens, pos, None).double()
            ref = build_gpt(r.model, r.parallel, 250, 32, "fp32").eval()
            ref.load_state_dict({k: v for k, v in model.state_dict().items() if "_quantizer" not in k},
                                strict=True)
            unquantized = ref(tokens, pos, None).double()
        scale = weights_only.abs().max()
        assert (got - weights_only).abs().max() <= 1e-5 * scale
        assert (unquantized - weights_only).abs().max() > 1e-3 * scale  # the grid is live in what is compared
        if fmt == "int4_awq":  # weight-only: the quantized model itself
            assert not acts and (got - fq).abs().max() <= 1e-5 * scale
        else:
            assert acts and (got - fq).abs().max() > 1e-5 * scale  # activation quantization is not reproduced


def _ct_input_quant(x, step, fmt):
    """compressed-tensors' static input fake quantization (quantization/lifecycle/forward_helpers.py:
    _quantize_dequantize): x / scale rounded onto the format's grid, times scale."""
    r = x / step
    q = r.clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) if fmt == "fp8" else r.round().clamp(-128, 127)
    return q * step


@pytest.mark.parametrize("fmt,groups,act", [("fp8", 2, "swiglu"), ("int8", 2, "swiglu"), ("int8_wo", 2, "swiglu"),
                                            ("int4_awq", 4, "swiglu"),
                                            ("int4_awq", 2, "swiglu"), ("int4_awq", 4, "gelu")])
def test_the_compressed_tensors_export_computes_the_quantized_model(fmt, groups, act):
    """export/compressed.plan: the quantized weights as codes x steps (codes on the format's grid), AWQ's input
    scales folded into the norms and into V's / up's rows, and static input steps. A plain model holding the plan's
    state, its quantized Linears' inputs fake-quantized with those steps as compressed-tensors does, gives the
    quantized model's logits (fp32 rounding). Where a scale cannot be folded (the query heads of a group disagree,
    a non-gated MLP) the Linear is written unquantized, and the logits still match."""
    from megatron_kd.export import compressed
    from megatron_kd.models import quant
    from megatron_kd.models.builder import build_gpt
    r0 = recipe("model.hidden_size=128", "model.ffn_hidden_size=256", "model.make_vocab_size_divisible_by=8",
                f"model.num_query_groups={groups}", f"model.activation={act}")
    from megatron_kd.runtime.dist import distributed
    torch.manual_seed(0)
    with distributed(r0.parallel, 1, "cpu"):
        model = build_gpt(r0.model, r0.parallel, 250, 32, "fp32")
        tokens, pos = torch.randint(0, 250, (2, 32)), torch.arange(32).expand(2, 32)
        quant.quantize(model, fmt, lambda m: m(tokens, pos, None))
        model.eval()
        p = compressed.plan(model, fmt)
        plain = build_gpt(r0.model, r0.parallel, 250, 32, "fp32").eval()
        plain.load_state_dict(p.state, strict=True)
        hooks = []
        for name, e in p.linears.items():
            c = e["codes"]
            assert c.dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
            if fmt == "int4_awq":
                assert int(c.min()) >= -8 and int(c.max()) <= 7 and e["step"].shape == (c.shape[0], c.shape[1] // 128)
            if compressed.SCHEMES[fmt]["input_activations"] is None:  # weight-only
                assert e["input_step"] is None
            else:
                amax = model.get_submodule(name).input_quantizer.amax.item()
                assert e["input_step"] == pytest.approx(amax / (448 if fmt == "fp8" else 127), rel=1e-6)
                hooks.append(plain.get_submodule(name).register_forward_pre_hook(
                    lambda mod, args, s=e["input_step"]: (_ct_input_quant(args[0], s, fmt), *args[1:])))
            assert torch.equal(p.state[f"{name}.weight"], compressed.dequantized(e))
        with torch.no_grad():
            fq = model(tokens, pos, None).double()
            got = plain(tokens, pos, None).double()
            for h in hooks:
                h.remove()
            no_inputs = plain(tokens, pos, None).double()
    scale = fq.abs().max()
    assert (got - fq).abs().max() <= 1e-5 * scale
    if compressed.SCHEMES[fmt]["input_activations"] is not None:  # the input quantization is live in what is compared
        assert (no_inputs - fq).abs().max() > 1e-3 * scale
    dense = {n.split(".")[-1] for n in p.dense}
    if fmt == "int4_awq" and groups == 2:
        assert dense == {"linear_proj"}  # the 2 query heads of a group have their own AWQ scales
    elif act == "gelu":
        assert dense == {"linear_fc2"}  # gelu(fc1 x): no row of fc1 reaches fc2's input linearly
    else:
        assert not dense and len(p.linears) == 4 * r0.model.num_layers


def test_int8_weight_only_is_each_weight_row_on_its_int8_grid_and_nothing_else():
    """quant.format=int8_wo (quant_formats/int8_wo.py, ModelOpt's INT8_WEIGHT_ONLY_CFG): the quantized model computes
    what the plain model computes with each linear layer's weight rounded onto the symmetric int8 grid of its row
    (step = max |row| / 127, in float64 here); inputs and the output layer stay unquantized."""
    from megatron_kd.models import quant
    from megatron_kd.models.builder import build_gpt
    with tiny_quantized("int8_wo") as (r, model, tokens, pos):
        model.eval()
        assert not quant.activation_quantizers(model)
        linears = [n[:-len(".weight_quantizer")] for n in quant.enabled_quantizers(model)]
        assert linears and all(n.endswith(".weight_quantizer") for n in quant.enabled_quantizers(model))
        state = {k: v for k, v in model.state_dict().items() if "_quantizer" not in k}
        plain_state = dict(state)
        for name in linears:
            w = state[f"{name}.weight"].double()
            step = w.abs().amax(dim=1, keepdim=True) / 127
            state[f"{name}.weight"] = (torch.round(w / step).clamp(-127, 127) * step).float()
        ref = build_gpt(r.model, r.parallel, 250, 32, "fp32").eval()
        ref.load_state_dict(state, strict=True)
        plain = build_gpt(r.model, r.parallel, 250, 32, "fp32").eval()
        plain.load_state_dict(plain_state, strict=True)
        with torch.no_grad():
            got, want = model(tokens, pos, None).double(), ref(tokens, pos, None).double()
            unquantized = plain(tokens, pos, None).double()
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale
    assert (unquantized - want).abs().max() > 1e-3 * scale  # the grid is live in what is compared
