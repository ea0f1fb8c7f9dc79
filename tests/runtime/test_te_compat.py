"""Transformer Engine beside megatron-core's own layers (megatron_kd/runtime/te_compat.py), on CPU:
- the weight-gradient fusion flag on a model whose megatron-core linears cannot fuse (no apex): the build succeeds,
  exactly those linears run unfused, and the model computes what the same model without the flag computes;
- the cuDNN clash: two cuDNN directories in a process's maps are named with the fix; one is no clash;
- the restart that puts torch's cuDNN first: the command line and environment it restarts with, and never twice.
The TE side (TE's linears keeping the fusion, sequential experts under TE's spec, FP8): tests/models/test_te_gpu.py."""
import os

import re

import pytest
import torch

from dist_utils import run_ranks

from megatron_kd.runtime import features, te_compat


def _config(**kw):
    from megatron_kd.recipe.schema import ModelConfig
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                       attention_backend="sdpa", **kw)


def _worker(rank, world, out):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron_kd.models.builder import build_gpt
    from megatron_kd.recipe.schema import ParallelConfig
    from megatron_kd.runtime.cpu_patches import apply_cpu_patches
    apply_cpu_patches()
    ps.initialize_model_parallel()
    from megatron.core import tensor_parallel
    res = {"apex": te_compat.apex_wgrad_available()}
    toks = torch.randint(0, 64, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    outs = {}
    for name, extra in (("plain", {}), ("fused_flag", {"gradient_accumulation_fusion": True})):
        tensor_parallel.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
        torch.manual_seed(0)
        m = build_gpt(_config(megatron=extra), ParallelConfig(), 64, 16, "fp32")
        assert m.config.gradient_accumulation_fusion == bool(extra)
        linears = [x for x in m.modules() if isinstance(x, (ColumnParallelLinear, RowParallelLinear))]
        res[name + "_linears"] = len(linears)
        res[name + "_still_fused"] = sum(x.gradient_accumulation_fusion for x in linears)
        logits = m(toks, pos, None)
        logits.float().pow(2).mean().backward()
        outs[name] = (logits.detach(), {k: p.grad.detach().clone() for k, p in m.named_parameters()})
    res["logits_equal"] = torch.equal(outs["plain"][0], outs["fused_flag"][0])
    res["grads_equal"] = all(torch.equal(outs["plain"][1][k], g) for k, g in outs["fused_flag"][1].items())
    # without the helper, megatron-core itself refuses the flag where apex is missing: what users met at build
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron_kd.models.builder import layer_spec, transformer_config
    cfg = transformer_config(_config(megatron={"gradient_accumulation_fusion": True}), ParallelConfig())
    try:
        GPTModel(cfg, layer_spec(_config()), vocab_size=64, max_sequence_length=16)
        res["bare_refuses"] = False
    except RuntimeError as e:
        res["bare_refuses"] = "fused_weight_gradient_mlp_cuda" in str(e)
    ps.destroy_model_parallel()
    torch.save(res, out)


def test_wgrad_fusion_flag_builds_without_apex_and_changes_nothing(tmp_path):
    out = str(tmp_path / "res.pt")
    run_ranks(1, _worker, out)
    res = torch.load(out)
    if res["apex"]:
        pytest.skip("apex's fused_weight_gradient_mlp_cuda is installed: the flag is megatron-core's own business")
    assert res["bare_refuses"], "megatron-core no longer refuses the flag without apex: the helper may be moot"
    assert res["fused_flag_linears"] == res["plain_linears"] > 0
    assert res["fused_flag_still_fused"] == 0  # every megatron-core linear turned back to autograd accumulation
    assert res["logits_equal"] and res["grads_equal"]


MAPS = """7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libcudnn_graph.so.9.14.0
7f02-7f03 r-xp 00000000 08:01 2 /venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9
7f04-7f05 r-xp 00000000 08:01 3 /venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn_graph.so.9
7f06-7f07 r--p 00000000 08:01 4 /usr/lib/libc.so.6
7f08-7f09 rw-p 00000000 00:00 0
"""


def test_cudnn_clash_names_both_directories_and_the_fix(monkeypatch):
    monkeypatch.setattr(te_compat, "torch_cudnn_dir", lambda: "/venv/lib/python3.12/site-packages/nvidia/cudnn/lib")
    msg = te_compat.cudnn_clash(MAPS)
    assert "/usr/lib/x86_64-linux-gnu" in msg and "/venv/lib/python3.12/site-packages/nvidia/cudnn/lib" in msg
    assert "export LD_LIBRARY_PATH=/venv/lib/python3.12/site-packages/nvidia/cudnn/lib:$LD_LIBRARY_PATH" in msg
    assert msg.count(".") <= 3 and "\n" not in msg


def test_one_cudnn_is_no_clash():
    one = "\n".join(line for line in MAPS.splitlines() if "/usr/lib/x86_64" not in line)
    if torch.cuda.is_available():
        pytest.skip("on a GPU torch's own version check also runs")
    assert te_compat.cudnn_clash(one) is None
    assert te_compat.cudnn_clash("") is None


def test_torch_cudnn_env_puts_torch_cudnn_first(monkeypatch):
    monkeypatch.setattr(te_compat, "torch_cudnn_dir", lambda: "/t/cudnn/lib")
    assert te_compat.torch_cudnn_env({"LD_LIBRARY_PATH": "/a:/b"})["LD_LIBRARY_PATH"] == "/t/cudnn/lib:/a:/b"
    assert te_compat.torch_cudnn_env({})["LD_LIBRARY_PATH"] == "/t/cudnn/lib"
    assert te_compat.torch_cudnn_env({"LD_LIBRARY_PATH": "/t/cudnn/lib:/a"}) is None
    monkeypatch.setattr(te_compat, "torch_cudnn_dir", lambda: None)  # a container's torch: the system cuDNN
    assert te_compat.torch_cudnn_env({"LD_LIBRARY_PATH": "/a"}) is None


def test_reexec_restarts_once_with_torch_cudnn_first(monkeypatch):
    import importlib.util
    calls = []
    monkeypatch.setattr(te_compat, "torch_cudnn_dir", lambda: "/t/cudnn/lib")
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: object() if n == "transformer_engine" else real_find(n, *a))
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.setattr("sys.orig_argv", ["/usr/bin/python3", "/usr/bin/megatron-kd", "train", "kd.top_k=8"],
                        raising=False)
    monkeypatch.delenv("MEGATRON_KD_NO_CUDNN_REEXEC", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", "/sys/lib")
    te_compat.reexec_with_torch_cudnn()
    assert len(calls) == 1
    exe, argv, env = calls[0]
    assert argv[1:] == ["/usr/bin/megatron-kd", "train", "kd.top_k=8"]
    assert env["LD_LIBRARY_PATH"] == "/t/cudnn/lib:/sys/lib" and env["MEGATRON_KD_NO_CUDNN_REEXEC"] == "1"
    monkeypatch.setenv("MEGATRON_KD_NO_CUDNN_REEXEC", "1")  # the restarted process: never again
    te_compat.reexec_with_torch_cudnn()
    assert len(calls) == 1
    monkeypatch.delenv("MEGATRON_KD_NO_CUDNN_REEXEC")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "transformer_engine" else real_find(n, *a))
    te_compat.reexec_with_torch_cudnn()  # no TE: nothing can load a second cuDNN
    assert len(calls) == 1


# --- models whose attention TE's core attention does not reproduce (sinks, sliding windows) -----------------------

@pytest.mark.parametrize("fields, unverified", [
    ({}, False), ({"softmax_type": "learnable"}, True), ({"softmax_type": "off-by-one"}, True),
    ({"window_size": [127, 0], "window_attn_skip_freq": 2}, True)], ids=["plain", "sinks", "off_by_one", "window"])
def test_te_spec_keeps_megatron_kd_core_attention_for_sinks_and_windows(monkeypatch, fields, unverified):
    """Where TE imports, `auto` and `te` build TE's spec; a model with sinks or a window gets megatron-kd's core
    attention in it (TE's spec itself needs TE, so the spec builder is observed here; tests/models/test_te_gpu.py
    builds it on the GPU)."""
    from megatron_kd.models import builder
    assert te_compat.te_attention_unverified(_config(**fields)) is unverified
    monkeypatch.setattr(features, "te_available", lambda: True)
    seen = []
    monkeypatch.setattr(builder, "te_spec", lambda *a: seen.append(a[-1]) or "spec")
    for backend in ("auto", "te"):
        m = _config(**fields)
        m.attention_backend = backend
        assert builder.spec_backend(m) == "te"
        assert builder.layer_spec(m) == "spec"
    assert seen == [unverified, unverified]
    monkeypatch.setattr(features, "te_available", lambda: False)
    m = _config(**fields)
    m.attention_backend = "auto"
    assert builder.spec_backend(m) == "sdpa"
    m.attention_backend = "te"
    with pytest.raises(RuntimeError, match="attention_backend=te but Transformer Engine does not import"):
        builder.spec_backend(m)


def test_own_core_attention_replaces_the_core_attention_of_a_layer_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron_kd.models.attention import SDPAttention
    from megatron_kd.models.builder import own_core_attention
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    assert te_compat.spec_submodules(te_compat.spec_submodules(spec).self_attention).core_attention \
        is not SDPAttention
    own_core_attention(spec, SDPAttention)
    assert te_compat.spec_submodules(te_compat.spec_submodules(spec).self_attention).core_attention is SDPAttention


@pytest.mark.parametrize("key, value", [("fp8", "hybrid")])
def test_recipe_with_sinks_refuses_fp8_naming_the_key(monkeypatch, key, value):
    from megatron_kd.recipe import checks
    from megatron_kd.recipe.schema import RecipeError
    monkeypatch.setattr(features, "te_available", lambda: True)
    m = _config(softmax_type="learnable", window_size=[127, 0], window_attn_skip_freq=2)
    m.attention_backend = "auto"
    setattr(m, key, value)
    with pytest.raises(RecipeError, match=rf"teacher\.{key}={value}.*set teacher\."):
        checks.check_model(m, "teacher", 1)
    m2 = _config()  # the same key on a model without sinks / window passes this rule
    m2.attention_backend = "auto"
    setattr(m2, key, value)
    try:
        checks.check_model(m2, "teacher", 1)
    except RecipeError as e:
        assert "sinks" not in str(e), e


@pytest.mark.parametrize("cuda", [False, True])
def test_recipe_with_sinks_refuses_context_parallel_naming_the_key(cuda):
    """parallel.cp > 1 with GPT-OSS's sinks / windows: their core attention (megatron-kd's, under TE's layers too)
    has no context-parallel exchange; refused before any work, the model's name and the fix given. The online
    teacher the same."""
    from megatron_kd.recipe.checks import check_recipe
    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import RecipeError, to_recipe
    sinks = ["model.softmax_type=learnable", "model.window_size=[15,0]", "model.window_attn_skip_freq=2"]
    base = ["data=mock", "data.vocab_size=64", "kd.cache=/c", "parallel.cp=2"]
    with pytest.raises(RecipeError, match=r"^parallel\.cp=2: model has attention sinks / sliding windows .*"
                                          r"set parallel\.cp=1"):
        check_recipe(to_recipe(compose("tiny_cpu", [*base, *sinks])), None, cuda)
    r = to_recipe(compose("tiny_cpu", [*base, "kd=online", "teacher.softmax_type=learnable"]))
    with pytest.raises(RecipeError, match=r"^parallel\.cp=2: teacher has attention sinks"):
        check_recipe(r, None, cuda)
    if cuda:  # a model without them passes this rule
        check_recipe(to_recipe(compose("tiny_cpu", base)), None, True)


def _sp_recipe(*overrides):
    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import to_recipe
    return to_recipe(compose("tiny_cpu", ["data=mock", "data.vocab_size=64", "kd=ce", "parallel.tp=2",
                                          "parallel.sequence_parallel=true", *overrides]))


def _machine(monkeypatch, te: bool, apex: bool):
    monkeypatch.setattr(features, "te_available", lambda: te)
    monkeypatch.setattr(features, "apex_available", lambda: apex)


@pytest.mark.parametrize("backend", ["sdpa", "local"])
def test_sequence_parallel_is_refused_where_the_spec_built_has_torch_norms(monkeypatch, backend):
    """Where TE imports and apex does not, attention_backend=sdpa / local still builds megatron-core's local spec,
    whose torch norms assert sequence_parallel is off (a crash at the build): refused by the recipe's checks, naming
    the key and a fix that works here. auto (TE's spec here) passes."""
    from megatron_kd.recipe.checks import check_run
    from megatron_kd.recipe.schema import RecipeError
    _machine(monkeypatch, te=True, apex=False)
    with pytest.raises(RecipeError) as e:
        check_run(_sp_recipe(f"model.attention_backend={backend}"), 2, True, 64)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        f"parallel.sequence_parallel=true with parallel.tp=2: model.attention_backend={backend} builds model's "
        "RMSNorm layers as megatron-core's torch norms, which refuse sequence parallel; set "
        "model.attention_backend=te (or auto: Transformer Engine imports here), or set "
        "parallel.sequence_parallel=false"), msg
    check_run(_sp_recipe("model.attention_backend=auto"), 2, True, 64)


def test_sequence_parallel_checks_the_teacher_that_runs(monkeypatch):
    """An online teacher is built with the same parallel layout: its spec is checked too, by its own key."""
    from megatron_kd.recipe.checks import check_run
    from megatron_kd.recipe.schema import RecipeError
    _machine(monkeypatch, te=True, apex=False)
    online = ["kd=online", "teacher.load=/t", "teacher.attention_backend=sdpa"]
    with pytest.raises(RecipeError, match=r"^parallel\.sequence_parallel=true with parallel\.tp=2: "
                                          r"teacher\.attention_backend=sdpa builds teacher's RMSNorm layers .* set "
                                          r"teacher\.attention_backend=te"):
        check_run(_sp_recipe(*online), 2, True, 64)
    check_run(_sp_recipe("teacher.attention_backend=sdpa"), 2, True, 64)  # kd=ce: no teacher runs


def test_sequence_parallel_checks_the_teacher_of_a_cache_build_from_a_recipe(monkeypatch):
    """`megatron-kd cache build --recipe` builds the recipe's teacher on its parallel layout (recipe_teacher): its
    spec is checked by the teacher's key before the teacher is built; on the CPU sequence parallel is not used."""
    from megatron_kd.teacher import factories
    from megatron_kd.recipe.schema import RecipeError
    _machine(monkeypatch, te=True, apex=False)
    built = []
    monkeypatch.setattr("megatron_kd.teacher.megatron.start_cache_teacher", lambda r, v: built.append(r) or "t")
    over = ["data=mock", "data.vocab_size=64", "parallel.tp=2", "parallel.sequence_parallel=true", "teacher.load=/t",
            "teacher.attention_backend=sdpa"]
    monkeypatch.setattr(factories, "use_cuda", lambda device: True)
    with pytest.raises(RecipeError, match=r"^parallel\.sequence_parallel=true with parallel\.tp=2: "
                                          r"teacher\.attention_backend=sdpa builds teacher's RMSNorm layers"):
        factories.recipe_teacher("tiny_cpu", over)
    assert not built
    assert factories.recipe_teacher("tiny_cpu", [*over[:-1], "teacher.attention_backend=auto"]) == "t"
    monkeypatch.setattr(factories, "use_cuda", lambda device: False)
    assert factories.recipe_teacher("tiny_cpu", over) == "t"


@pytest.mark.parametrize("norm, passes", [("RMSNorm", False), ("LayerNorm", True)])
def test_sequence_parallel_with_apex_without_te_takes_only_apex_norms(monkeypatch, norm, passes):
    """Without TE, auto builds the SDPA spec: apex gives it a fused LayerNorm, but megatron-core's local spec builds
    an RMSNorm as its torch norm with or without apex."""
    from megatron_kd.recipe.checks import check_run
    from megatron_kd.recipe.schema import RecipeError
    _machine(monkeypatch, te=False, apex=True)
    r = _sp_recipe(f"model.normalization={norm}")
    if passes:
        check_run(r, 2, True, 64)
        return
    with pytest.raises(RecipeError, match=r"model\.attention_backend=auto \(Transformer Engine does not import "
                                          r"here\) builds model's RMSNorm layers as megatron-core's torch norms, .* "
                                          r"run where Transformer Engine imports"):
        check_run(r, 2, True, 64)


def test_recipe_with_sinks_takes_te_layers(monkeypatch):
    """attention_backend=te on a model with sinks / a window: TE's layers with megatron-kd's core attention."""
    from megatron_kd.recipe import checks
    monkeypatch.setattr(features, "te_available", lambda: True)
    m = _config(softmax_type="learnable", window_size=[127, 0], window_attn_skip_freq=2)
    m.attention_backend = "te"
    checks.check_model(m, "teacher", 1)


def test_fp8_attention_is_checked_by_name(monkeypatch):
    """model.fp8_attention needs FP8 layers and the delayed recipe (TE has no FP8 attention backend for current
    scaling on Hopper): refused by name before any work; fp8=hybrid, fp8_recipe=delayed passes."""
    from megatron_kd.recipe import checks
    from megatron_kd.recipe.schema import RecipeError
    monkeypatch.setattr(features, "te_available", lambda: True)
    m = _config()
    m.attention_backend = "auto"
    m.fp8_attention = True
    with pytest.raises(RecipeError, match=r"^model\.fp8_attention=true needs FP8 layers: set model\.fp8=hybrid"):
        checks.check_model(m, "model", 1)
    m.fp8 = "hybrid"
    for recipe in ("tensorwise", "blockwise"):
        m.fp8_recipe = recipe
        with pytest.raises(RecipeError, match=rf"^model\.fp8_attention=true with model\.fp8_recipe={recipe}: .*"
                                              r"set model\.fp8_recipe=delayed"):
            checks.check_model(m, "model", 1)
    m.fp8_recipe = "delayed"
    checks.check_model(m, "model", 1)


def test_fp8_fields_reach_both_builders():
    """The recipe builder's TransformerConfig and Bridge's provider (HF checkpoints, through the overrides) get
    the same FP8 fields; without model.fp8 none (bf16)."""
    from megatron_kd.recipe.fp8 import fp8_kwargs
    m = _config()
    assert fp8_kwargs(m) == {}
    m.fp8, m.fp8_recipe, m.fp8_attention = "hybrid", "delayed", True
    assert fp8_kwargs(m) == dict(fp8="hybrid", fp8_recipe="delayed", fp8_dot_product_attention=True)


def test_fp8_fields_are_what_the_builder_gives_megatron_core():
    """fp8_fields (what the planner counts) equals the FP8 fields of the TransformerConfig the builder makes, with
    FP8 set by the section's keys, by `megatron:` alone (megatron-core's default recipe then) and by both."""
    from dataclasses import replace
    from megatron_kd.models.builder import transformer_config
    from megatron_kd.recipe.fp8 import MEGATRON_FP8_KEYS, fp8_fields
    from megatron_kd.recipe.schema import ParallelConfig
    base = _config()
    cases = [replace(base, fp8="hybrid", fp8_recipe="tensorwise"),
             replace(base, megatron={"fp8": "hybrid"}),
             replace(base, fp8="hybrid", fp8_recipe="tensorwise", megatron={"fp8_recipe": "delayed",
                                                                            "fp8_dot_product_attention": True})]
    assert fp8_fields(base) == {}
    for m in cases:
        config = transformer_config(m, ParallelConfig(), "bf16")
        assert fp8_fields(m) == {k: getattr(config, k) for k in MEGATRON_FP8_KEYS}, m.megatron


def test_hf_students_get_fp8_through_the_provider(monkeypatch):
    """An HF checkpoint's student with model.fp8 is built by Bridge's provider with the FP8 fields (it trained in
    bf16 with no word when they were not passed); model.megatron still wins over them."""
    from megatron_kd.hf import model as hf_model
    from megatron_kd.models import builder
    from megatron_kd.recipe.schema import ParallelConfig
    seen = {}

    class FakeHF:
        def architecture(self):
            return {"num_moe_experts": None, "add_bias_linear": False}  # dense: TE's layers stay

        def build(self, p, **kw):
            seen.update(kw)
            return [], None
    monkeypatch.setattr(hf_model, "open_hf", lambda path, key: FakeHF())
    monkeypatch.setattr(builder, "spec_backend", lambda m: "te")
    m = _config(hf_path="/x", fp8="hybrid", fp8_recipe="delayed", fp8_attention=True,
                megatron={"fp8_recipe": "tensorwise", "moe_grouped_gemm": True})
    builder.build_hf_chunks(m, ParallelConfig(), 128, "bf16")
    assert seen["overrides"] == dict(fp8="hybrid", fp8_recipe="tensorwise", fp8_dot_product_attention=True,
                                     moe_grouped_gemm=True)
    builder.build_hf_chunks(_config(hf_path="/x"), ParallelConfig(), 128, "bf16")
    assert seen["overrides"] == {}


@pytest.mark.parametrize("fields, fused", [
    (dict(activation="quick_geglu", activation_func_clamp_value=7.0, glu_linear_offset=1.0), False),  # GPT-OSS
    (dict(activation="quick_geglu", glu_linear_offset=1.0, megatron={"activation_func_clamp_value": 7.0}), False),
    (dict(activation="quick_geglu", activation_func_clamp_value=7.0, glu_linear_offset=1.0,
          megatron={"bias_activation_fusion": True}), True),  # asked for by name: the user's call
    (dict(activation="swiglu"), True),
    (dict(activation="gelu"), True),
    (dict(activation="squared_relu"), False),  # megatron-core has no fused kernel for it (its MLP raises)
], ids=["gpt_oss", "clamp_through_megatron", "explicit", "swiglu", "gelu", "squared_relu"])
def test_builder_fuses_bias_activation_only_where_megatron_core_computes_it_exactly(monkeypatch, fields, fused):
    """Under TE on a GPU the builder fuses bias + activation for biased linears only where megatron-core has a
    kernel that computes the unfused result: not for a clamped GLU (GPT-OSS: the fused quick-GEGLU clamps before
    adding the bias; tests/models/test_gpt_oss_hf.py measures the departure), also when the clamp comes through
    the `megatron:` pass-through, and not where no kernel exists."""
    from megatron_kd.models import builder
    from megatron_kd.recipe.schema import ParallelConfig
    monkeypatch.setattr(builder, "spec_backend", lambda m: "te")
    monkeypatch.setattr(builder.torch.cuda, "is_available", lambda: True)
    m = _config(add_bias_linear=True, **fields)
    kw = {}
    monkeypatch.setattr("megatron.core.transformer.transformer_config.TransformerConfig",
                        lambda **k: kw.update(k) or k)
    try:
        builder.transformer_config(m, ParallelConfig(), "bf16")
    except Exception:  # noqa: BLE001  (only the fields handed to TransformerConfig matter here)
        pass
    assert kw and kw["bias_activation_fusion"] is fused, kw.get("bias_activation_fusion")


def test_the_exact_fusion_rule_reads_recipes_and_megatron_configs():
    """The same rule on a recipe's ModelConfig (activation names) and on megatron-core field names (a provider)."""
    import torch.nn.functional as F
    from types import SimpleNamespace
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: F401  (megatron present)
    exact = te_compat.bias_activation_fusion_exact
    assert exact(_config(activation="swiglu")) and not exact(_config(activation="squared_relu"))
    assert not exact(_config(activation="quick_geglu", activation_func_clamp_value=7.0))
    assert exact(SimpleNamespace(activation_func=F.silu, gated_linear_unit=True))
    assert not exact(SimpleNamespace(activation_func=F.silu, gated_linear_unit=False))
    assert exact(SimpleNamespace(activation_func=F.gelu, gated_linear_unit=False))
    assert not exact(SimpleNamespace(activation_func=quick_gelu, gated_linear_unit=True,
                                     activation_func_clamp_value=7.0))


def test_a_cache_records_fp8_and_fp8_attention_of_a_te_teacher():
    """The backend a cache records tells TE's layers, their FP8 and TE's FP8 attention apart."""
    from types import SimpleNamespace
    import torch
    from megatron_kd.teacher.megatron import layer_backend
    te_linear = type("Linear", (torch.nn.Module,), {"__module__": "transformer_engine.pytorch.module.linear"})

    def model(**config):
        m = torch.nn.Sequential(te_linear())
        m.config = SimpleNamespace(**config)
        return m
    assert layer_backend(model(fp8=None)) == "te"
    assert layer_backend(model(fp8="hybrid", fp8_dot_product_attention=False)) == "te+fp8"
    assert layer_backend(model(fp8="hybrid", fp8_dot_product_attention=True)) == "te+fp8+fp8_attention"
    assert layer_backend(torch.nn.Sequential(torch.nn.Linear(2, 2))) == "local"


def test_a_te_final_norm_alone_does_not_make_a_te_teacher():
    """megatron-core gives every layer spec a TE final norm where TE imports; an SDPA spec's model stays sdpa."""
    from types import SimpleNamespace
    import torch
    from megatron_kd.teacher.megatron import layer_backend
    te_norm = type("RMSNorm", (torch.nn.Module,), {"__module__": "transformer_engine.pytorch.module.rmsnorm"})
    sdpa = type("SDPAttention", (torch.nn.Module,), {"__module__": "megatron_kd.models.attention"})
    decoder = torch.nn.Module()
    decoder.layers = torch.nn.ModuleList([sdpa()])
    decoder.final_layernorm = te_norm()
    model = torch.nn.Module()
    model.decoder, model.config = decoder, SimpleNamespace(fp8=None)
    assert layer_backend(model) == "sdpa"
    decoder.layers.append(te_norm())  # a TE module inside the layers is TE's spec
    assert layer_backend(model) == "te"


def test_fp8_set_through_megatron_is_checked_by_its_key(monkeypatch):
    """FP8 set in the `megatron:` pass-through reaches megatron-core (recipe/fp8.fp8_fields) as model.fp8 does, so
    the FP8 rules hold for it too, naming the key the user set: it trained in bf16 on the local spec with no word
    (model.megatron.fp8=hybrid without TE, or with attention_backend=sdpa), and took any value (fp4). Each fix
    given passes."""
    from dataclasses import replace
    from megatron_kd.recipe import checks
    from megatron_kd.recipe.schema import RecipeError
    monkeypatch.setattr(features, "te_available", lambda: False)
    m = _config(megatron={"fp8": "hybrid"}, fp8_recipe="delayed")  # the recipe megatron-core runs by default
    m.attention_backend = "auto"
    with pytest.raises(RecipeError, match=r"^model\.megatron\.fp8=hybrid needs Transformer Engine.*"
                                          r"set model\.megatron\.fp8=null"):
        checks.check_model(m, "model", 1)
    checks.check_model(replace(m, megatron={"fp8": None}), "model", 1)
    monkeypatch.setattr(features, "te_available", lambda: True)
    checks.check_model(m, "model", 1)
    with pytest.raises(RecipeError, match=r"^model\.megatron\.fp8=hybrid runs in Transformer Engine's layers but "
                                          r"model\.attention_backend=sdpa; set model\.attention_backend=te"):
        checks.check_model(replace(m, attention_backend="sdpa"), "model", 1)
    with pytest.raises(RecipeError, match=r"^teacher\.megatron\.fp8='fp4': use one of"):
        checks.check_model(replace(m, megatron={"fp8": "fp4"}), "teacher", 1)
    with pytest.raises(RecipeError, match=r"^model\.megatron\.fp8_recipe='foo': use one of"):
        checks.check_model(replace(m, fp8="hybrid", megatron={"fp8_recipe": "foo"}), "model", 1)
    attn = replace(m, fp8="hybrid", fp8_recipe="tensorwise", megatron={"fp8_dot_product_attention": True})
    with pytest.raises(RecipeError, match=r"^model\.megatron\.fp8_dot_product_attention=true with "
                                          r"model\.fp8_recipe=tensorwise: .*set model\.fp8_recipe=delayed"):
        checks.check_model(attn, "model", 1)
    checks.check_model(replace(attn, fp8_recipe="delayed"), "model", 1)
    sinks = replace(m, softmax_type="learnable", window_size=[127, 0], window_attn_skip_freq=2)
    with pytest.raises(RecipeError, match=r"^teacher\.megatron\.fp8=hybrid: FP8 has not been checked.*"
                                          r"set teacher\.megatron\.fp8=null"):
        checks.check_model(sinks, "teacher", 1)
    checks.check_model(replace(sinks, megatron={"fp8": None}), "teacher", 1)


@pytest.mark.parametrize("megatron, runs", [({"fp8": "hybrid"}, "delayed (megatron-core's default)"),
                                            ({"fp8": "hybrid", "fp8_recipe": "blockwise"},
                                             "blockwise (model.megatron.fp8_recipe)")])
def test_fp8_from_megatron_alone_does_not_ignore_the_sections_fp8_recipe(monkeypatch, megatron, runs):
    """FP8 set only in the pass-through runs the recipe megatron-core gets there (its default: delayed), not
    model.fp8_recipe: a different model.fp8_recipe (the schema's tensorwise included) was silently ignored, and the
    plan counted the other recipe's buffers. Refused naming both; each fix given passes."""
    from dataclasses import replace
    from megatron_kd.recipe import checks
    from megatron_kd.recipe.fp8 import fp8_fields
    from megatron_kd.recipe.schema import RecipeError
    monkeypatch.setattr(features, "te_available", lambda: True)
    m = _config(megatron=megatron, fp8_recipe="tensorwise")
    m.attention_backend = "auto"
    with pytest.raises(RecipeError, match=rf"^model\.megatron\.fp8=hybrid runs the FP8 recipe {re.escape(runs)}, "
                                          r"not model\.fp8_recipe=tensorwise; set model\.fp8=hybrid instead of "
                                          r"model\.megatron\.fp8 .* or model\.fp8_recipe="):
        checks.check_model(m, "model", 1)
    recipe = runs.split()[0]
    checks.check_model(replace(m, fp8_recipe=recipe), "model", 1)
    own = replace(m, fp8="hybrid", megatron={k: v for k, v in megatron.items() if k != "fp8"})
    checks.check_model(own, "model", 1)
    assert fp8_fields(own)["fp8_recipe"] == megatron.get("fp8_recipe", "tensorwise")


def test_a_misspelt_fp8_recipe_is_refused_with_fp8_off():
    """model.fp8_recipe=foo without model.fp8 trained with no word (the key is read only when FP8 is on); the
    value is refused by name wherever it is, and the fix (a listed recipe) passes with FP8 off."""
    from dataclasses import replace
    from megatron_kd.recipe import checks
    from megatron_kd.recipe.schema import RecipeError
    m = _config(fp8_recipe="foo")
    with pytest.raises(RecipeError, match=r"^teacher\.fp8_recipe='foo': use one of \('tensorwise', 'delayed'"):
        checks.check_model(m, "teacher", 1)
    checks.check_model(replace(m, fp8_recipe="delayed"), "teacher", 1)
