"""megatron_kd.plan: exact parameter counts against real Megatron GPTModels (CPU, gloo), activation bytes
against what autograd saves, hand-computed memory formulas, and the `megatron-kd plan` CLI."""
import json
import os
import subprocess
import sys

import pytest

from dist_utils import run_ranks
from megatron_kd.loss import FusedSettings
from megatron_kd.plan import GIB, Layout, ModelShape, Training, layer_activations, plan_memory, preset
from megatron_kd.plan.memory import loss_buffers
from megatron_kd.plan.recipe import model_config, parallel_config
from megatron_kd.plan.shapes import param_counts, total_params
from megatron_kd.rules import padded_vocab_size

Z_BYTES, E_BYTES = FusedSettings().z_mib << 20, FusedSettings().e_mib << 20  # the fused loss's default budgets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DENSE_TIED = ModelShape("t-dense", 2, 64, 8, 2, 16, 96, 256, tie_embeddings=True)
DENSE_BIAS = ModelShape("t-dense-ln", 3, 64, 4, 4, 16, 80, 384, normalization="LayerNorm", add_bias_linear=True,
                        add_qkv_bias=True, qk_layernorm=True, activation="gelu")
MOE = ModelShape("t-moe", 2, 64, 8, 2, 16, 96, 256, add_bias_linear=True, add_qkv_bias=True, num_moe_experts=4,
                 moe_router_topk=2, moe_ffn_hidden_size=48)
MOE_SHARED = ModelShape("t-moe-sh", 2, 64, 8, 2, 16, 96, 256, num_moe_experts=4, moe_router_topk=2,
                        moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=64)


def _megatron(layout):
    """Megatron's groups for `layout` on CPU, as `megatron-kd train` sets them up."""
    from megatron_kd.runtime.cpu_patches import megatron_compat
    from megatron_kd.runtime.dist import init_model_parallel, set_seed
    megatron_compat()
    init_model_parallel(parallel_config(layout), cuda=False)
    set_seed(1234)


def _build(shape, layout, seq_length=512):
    """The GPTModel `megatron-kd train` builds for this shape (training's builder, bf16 weights)."""
    from megatron_kd.models.builder import build_gpt
    return build_gpt(model_config(shape, layout), parallel_config(layout), shape.vocab_size, seq_length, "bf16")


def _counts(model):
    dense = expert = 0
    for n, p in model.named_parameters():
        if ".experts." in n:
            expert += p.numel()
        else:
            dense += p.numel()
    return dense, expert


def _check_counts(rank, world, layout, shapes):
    _megatron(layout)
    for shape in shapes:
        m = _build(shape, layout)
        dense, expert = _counts(m)
        pc = param_counts(shape, layout)
        assert (dense, expert) == (pc.dense, pc.expert), (shape.name, layout, (dense, expert), (pc.dense, pc.expert))


@pytest.mark.slow
def test_param_counts_match_megatron_tp1():
    run_ranks(1, _check_counts, Layout(), [DENSE_TIED, DENSE_BIAS, MOE, MOE_SHARED])


@pytest.mark.slow
def test_param_counts_match_megatron_tp2_and_ep2():
    # TP=2 without SP: Megatron's torch norms (no TE/apex) refuse sequence parallelism, and MoE at TP > 1
    # needs it, so MoE is checked at EP=2 (the counting code path for TP-sharded experts is the dense one's)
    run_ranks(2, _check_counts, Layout(tp=2, sequence_parallel=False), [DENSE_TIED, DENSE_BIAS])
    run_ranks(2, _check_counts, Layout(ep=2, dp=2), [MOE, MOE_SHARED])


def test_model_config_is_the_inverse_of_shape_from_config():
    """The planner's shapes become the recipe `model` section training builds from, and read back the same."""
    from megatron_kd.plan.recipe import shape_from_config
    for s in [DENSE_TIED, DENSE_BIAS, MOE, MOE_SHARED, *(preset(n) for n in ("llama-3.2-3b", "gpt-oss-20b"))]:
        assert shape_from_config(model_config(s), s.vocab_size, 4096) == s, s.name
    m = model_config(DENSE_TIED, Layout(vocab_divisible_by=64), recompute="full", recompute_layers=2)
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "block", 2)
    assert m.make_vocab_size_divisible_by == 64 and m.num_moe_experts is None


def test_preset_totals_are_the_published_counts():
    assert total_params(preset("llama-3.2-3b")) == 3_212_749_824
    assert total_params(preset("llama-3.1-8b")) == 8_030_261_248
    assert total_params(preset("llama-3.2-1b")) == 1_235_814_400
    assert round(total_params(preset("gpt-oss-20b")) / 1e9, 1) == 20.9
    assert round(total_params(preset("gpt-oss-120b")) / 1e9, 1) == 116.8


def test_padded_vocab_and_sharding():
    assert padded_vocab_size(128256, 128, 1) == 128256 and padded_vocab_size(201088, 128, 2) == 201216
    s = preset("gpt-oss-20b")
    full = param_counts(s, Layout(vocab_divisible_by=1))
    ep8 = param_counts(s, Layout(ep=8, dp=8, vocab_divisible_by=1))
    assert ep8.expert * 8 == full.expert and ep8.dense == full.dense
    tp2 = param_counts(s, Layout(tp=2, etp=1, vocab_divisible_by=1))
    assert tp2.embedding * 2 == full.embedding
    with pytest.raises(ValueError):
        param_counts(s, Layout(ep=3, dp=3))  # 32 experts
    with pytest.raises(ValueError):
        param_counts(preset("llama-3.2-3b"), Layout(ep=2, dp=2))  # dense model
    with pytest.raises(ValueError):
        param_counts(s, Layout(tp=2))  # GPT-OSS's expert biases need etp = 1


def _saved_bytes(rank, world, shape, T, moe, tol):
    """Per-layer bytes autograd saves (storages, parameters excluded) against layer_activations (CPU norms)."""
    import torch
    from megatron_kd.models.hook import forward_with_head
    _megatron(Layout())
    m = _build(shape, Layout(), T)
    params = {p.untyped_storage()._cdata for p in m.parameters()}
    cur, saved = ["out"], {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            saved.setdefault(cur[0], {})[st._cdata] = st.nbytes()
        return t
    for i, layer in enumerate(m.decoder.layers):
        layer.register_forward_pre_hook(lambda mod, a, i=i: cur.__setitem__(0, f"layer{i}"))
        layer.register_forward_hook(lambda mod, a, o: cur.__setitem__(0, "out"))
    ids = torch.randint(0, shape.vocab_size, (1, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_with_head(m, lambda hidden, weight: hidden, ids, torch.arange(T)[None], None)
    got = sum(saved["layer0"].values())
    want = sum(layer_activations(shape, Layout(), T, moe, fused_norm=False).values())
    assert abs(got / want - 1) <= tol, (shape.name, got, want)


@pytest.mark.slow
def test_saved_activations_dense_exact():
    run_ranks(1, _saved_bytes, DENSE_TIED, 512, False, 0.0)


@pytest.mark.slow
def test_saved_activations_moe():
    # expert tensors are exact; the router's small [T, E] / [T, k] tensors are approximated
    run_ranks(1, _saved_bytes, MOE.with_(add_bias_linear=False), 512, True, 0.03)


def test_static_memory_hand_computed():
    s = preset("llama-3.2-3b")
    P = total_params(s)
    p = plan_memory(s, Layout(), Training(seq_len=8192))
    assert p.get("weights") == 2 * P and p.get("grads") == 4 * P and p.get("optimizer") == 12 * P
    p4 = plan_memory(s, Layout(dp=4), Training(seq_len=8192))
    assert p4.get("optimizer") == 12 * P / 4 and p4.get("grads") == 4 * P
    nd = plan_memory(s, Layout(dp=4), Training(seq_len=8192, distributed_optimizer=False))
    assert nd.get("optimizer") == 12 * P
    bf = plan_memory(s, Layout(), Training(seq_len=8192, grad_fp32=False, main_grad_fusion=False))
    assert bf.get("grads") == 2 * P and bf.get("optimizer step") == 4 * P   # fp32 copy of the grads
    fe = plan_memory(s, Layout(), Training(seq_len=8192, adam_impl="foreach"))
    assert fe.get("optimizer step") == 4 * P                                # one fp32 temporary
    # GPT-OSS, EP=8 over 8 GPUs: experts / 8 on each rank, not sharded further (expert-DP = 1)
    g = preset("gpt-oss-20b")
    pc = param_counts(g, Layout(ep=8, dp=8))
    pg = plan_memory(g, Layout(ep=8, dp=8), Training(seq_len=32768))
    assert pg.get("optimizer") == pytest.approx(12 * pc.dense / 8 + 12 * pc.expert)


def test_activation_and_loss_formulas():
    s = preset("llama-3.2-3b")
    T, h = 32768, 3072
    p = plan_memory(s, Layout(), Training(seq_len=T))
    assert p.get("layer checkpoints") == 28 * 2 * T * h                     # one bf16 [T, H] per layer
    pn = plan_memory(s, Layout(), Training(seq_len=T, recompute="none"))
    per = sum(layer_activations(s, Layout(), T, False).values())
    assert pn.get("saved activations") == 28 * per
    # unfused SwiGLU keeps 5 [T, ffn] bf16 tensors' worth (fc1 out is 2 wide)
    a = layer_activations(s, Layout(), T, False)
    assert a["fc1 output"] + a["silu(gate), linear + offset"] + a["fc2 input"] == 2 * T * 8192 * 5
    V = s.vocab_size
    d = loss_buffers(s, Layout(), Training(seq_len=T, loss="dense"), T)
    assert d["fwd"] >= 3 * 4 * T * V                                          # logits, exp temporaries
    f = loss_buffers(s, Layout(), Training(seq_len=T, loss="fused"), T)
    assert f["fwd"] < 1.1 * (Z_BYTES + E_BYTES) and f["tail"] == 2 * V * h                   # tied: dummy wgrad until embedding
    c = loss_buffers(s, Layout(), Training(seq_len=T, loss="chunked"), T)
    assert c["bwd"] > 6 * V * h                                               # fp32 wgrad + bf16 copy
    # TP shards the per-layer tensors and (with SP) the residual stream
    a2 = layer_activations(s, Layout(tp=2), T, False)
    assert a2["fc1 output"] * 2 == a["fc1 output"] and a2["mlp input (norm2 out)"] * 2 == a["mlp input (norm2 out)"]


def test_pipeline_and_online():
    s = preset("llama-3.1-8b")
    tr = Training(seq_len=8192, num_microbatches=8, recompute="full")
    first = plan_memory(s, Layout(pp=4, dp=1), tr, stage=0)
    last = plan_memory(s, Layout(pp=4, dp=1), tr, stage=3)
    assert first.get("layer checkpoints") == 4 * 8 * 2 * 8192 * 4096        # 1F1B: pp micro-batches in flight
    assert last.get("layer checkpoints") == 1 * 8 * 2 * 8192 * 4096 and last.get("loss (forward)") > 0
    on = plan_memory(preset("llama-3.2-3b"), Layout(), Training(seq_len=8192, mode="online", teacher=s))
    assert on.get("teacher weights") == 2 * total_params(s, padded=True)
    with pytest.raises(ValueError):
        plan_memory(s, Layout(), Training(mode="online"))


def _cli(*args):
    from megatron_kd.cli.main import main
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["plan", *args])
    return rc, buf.getvalue()


def test_cli_table_json_and_search():
    rc, out = _cli("llama-3.2-3b", "--seq", "32768")
    assert rc == 0 and "static: weights" in out and "peak" in out and "fits" in out
    rc, out = _cli("gpt-oss-20b", "--seq", "32768", "--ep", "8", "--dp", "8", "--json")
    d = json.loads(out)
    assert rc == 0 and d["layout"]["ep"] == 8 and d["peak_gib"] > 0 and d["fits"] is True
    rc, out = _cli("gpt-oss-20b", "--seq", "32768", "--search", "8")
    assert rc == 0 and "-> 8 GPUs:" in out
    rc, out = _cli("gpt-oss-20b", "--seq", "32768", "--layers", "4", "--online", "gpt-oss-120b",
                   "--teacher-loss", "dense")
    assert rc == 0 and "teacher weights" in out
    rc, _ = _cli("gpt-oss-20b", "--ep", "3", "--dp", "3")
    assert rc == 2
    with pytest.raises(SystemExit):
        _cli("no-such-model")


def test_cli_reads_a_recipe(tmp_path):
    r = tmp_path / "my_recipe.yaml"
    r.write_text("model:\n  name: my-moe\n  num_layers: 4\n  hidden_size: 256\n  num_attention_heads: 8\n"
                 "  num_moe_experts: 8\n  recompute_granularity: selective\n"
                 "parallel:\n  ep: 8\ndata:\n  vocab_size: 1000\n  seq_length: 4096\n"
                 "kd:\n  mode: offline\n  cache: ???\n  top_k: 64\ntrain:\n  micro_batch_size: 1\n"
                 "  global_batch_size: 16\n  save: ${hydra:run.dir}\n")
    rc, out = _cli(str(r), "--json")
    d = json.loads(out)
    assert rc == 0 and d["layout"]["ep"] == 8 and d["layout"]["dp"] == 8 and d["training"]["seq_len"] == 4096
    assert d["training"]["topk"] == 64 and d["training"]["recompute"] == "selective"
    assert d["training"]["num_microbatches"] == 2 and d["shape"]["ffn_hidden_size"] == 1024
    assert d["shape"]["moe_ffn_hidden_size"] == 1024 and d["shape"]["tie_embeddings"] is True
    rc, out = _cli(str(r), "kd.mode=ce", "--json")
    assert json.loads(out)["training"]["mode"] == "ce"


# ------------------------------------------------------------------------------------- the real recipes

RECIPES = {  # what each file says (recipe file over its group files); world = the smallest the layout runs on
    "tiny_cpu": dict(shape="tiny-student", tp=1, pp=1, cp=1, ep=1, etp=1, dp=1, sp=False, recompute="none",
                     layers=None, seq=128, mbs=4, micro_batches=2, mode="offline", topk=16),
    "llama31_8b_to_3b_32k_1xh200": dict(shape="llama-3.2-3b", tp=1, pp=1, cp=1, ep=1, etp=1, dp=1, sp=False,
                                        recompute="full", layers=16, seq=32768, mbs=1, micro_batches=32,
                                        mode="offline", topk=100),
    "llama31_8b_to_3b_32k_1xh200_fp8": dict(shape="llama-3.2-3b", tp=1, pp=1, cp=1, ep=1, etp=1, dp=1, sp=False,
                                            recompute="full", layers=2, seq=32768, mbs=1, micro_batches=32,
                                            mode="offline", topk=100),
    # gpt-oss: CP=1 (its sink / window core attention refuses CP, under TE's layers too), so DP=8
    "gpt_oss_20b_32k_8xh200": dict(shape="gpt-oss-20b", tp=1, pp=1, cp=1, ep=8, etp=1, dp=8, sp=False,
                                   recompute="full", layers=16, seq=32768, mbs=1, micro_batches=8,
                                   mode="offline", topk=100),
    "gpt_oss_20b_32k_4node_online": dict(shape="gpt-oss-20b", tp=1, pp=1, cp=1, ep=8, etp=1, dp=8, sp=False,
                                         recompute="full", layers=16, seq=32768, mbs=1, micro_batches=8,
                                         mode="online", topk=100),
}

# the H100 recipes: the H200 recipe's layout with 21 layers recomputed
RECIPES.update({n: dict(RECIPES["llama31_8b_to_3b_32k_1xh200"], layers=21)
                for n in ("llama31_8b_to_3b_32k_1xh100", "llama31_8b_to_3b_32k_1xh100_fp8")})


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_real_recipes_are_read_as_training_reads_them(name):
    from megatron_kd.recipe.compose import compose
    from megatron_kd.plan.recipe import from_recipe, load_recipe
    want = RECIPES[name]
    rp = from_recipe(load_recipe(name))
    cfg = compose(name)  # what `megatron-kd train` gets (independent of the plan's reading)
    for k in ("tp", "pp", "cp", "ep"):
        assert getattr(rp.layout, k) == cfg.parallel[k] == want[k], (name, k)
    assert rp.layout.expert_tp == (cfg.parallel.etp or cfg.parallel.tp) == want["etp"]
    assert rp.layout.sp is want["sp"] and rp.layout.vocab_divisible_by == cfg.model.make_vocab_size_divisible_by
    assert (cfg.model.recompute_granularity or "none") == rp.training.recompute == want["recompute"]
    assert rp.training.recompute_layers == want["layers"]
    if want["layers"] is not None:
        assert cfg.model.recompute_method == "block" and cfg.model.recompute_num_layers == want["layers"]
    assert rp.shape.name == want["shape"] and rp.shape.vocab_size == cfg.data.vocab_size
    assert rp.training.seq_len == cfg.data.seq_length == want["seq"]
    assert rp.training.micro_batch == want["mbs"] and rp.training.mode == want["mode"] == cfg.kd.mode
    assert rp.training.topk == want["topk"] == cfg.kd.top_k
    if want["shape"] in ("gpt-oss-20b", "llama-3.2-3b"):
        assert rp.shape == preset(want["shape"])  # the model file is the published shape
    if want["mode"] == "online":
        assert rp.teacher == preset("gpt-oss-120b") and rp.training.teacher == rp.teacher
    rc, out = _cli(name, "--json")
    d = json.loads(out)
    assert rc == 0, out
    assert {k: d["layout"][k] for k in ("tp", "pp", "cp", "ep", "dp", "etp")} == \
        {k: want[k] for k in ("tp", "pp", "cp", "ep", "dp", "etp")}
    assert d["training"]["recompute"] == want["recompute"] and d["training"]["recompute_layers"] == want["layers"]
    assert d["training"]["num_microbatches"] == want["micro_batches"] and d["peak_gib"] > 0


def test_recipe_by_path_overrides_and_gpus():
    path = os.path.join(ROOT, "megatron_kd", "recipes", "gpt_oss_20b_32k_8xh200.yaml")
    rc, out = _cli(path)
    assert rc == 0 and "recompute full (16 of 24 layers, block)" in out and "peak" in out
    base = json.loads(_cli(path, "--json")[1])
    ep4 = json.loads(_cli("gpt_oss_20b_32k_8xh200", "parallel.ep=4", "--json")[1])
    assert ep4["layout"]["ep"] == 4 and ep4["layout"]["dp"] == 4 and ep4["training"]["num_microbatches"] == 16
    assert ep4["peak_gib"] > base["peak_gib"] + 1
    none = json.loads(_cli("gpt_oss_20b_32k_8xh200", "model.recompute_granularity=null", "--json")[1])
    assert none["training"]["recompute"] == "none" and none["peak_gib"] > base["peak_gib"] + 10
    # --gpus sets dp first, then the micro-batches are counted: 64 / (1 x 32)
    d = json.loads(_cli("gpt_oss_20b_32k_4node_online", "--gpus", "32", "--json")[1])
    assert d["layout"]["dp"] == 32 and d["training"]["num_microbatches"] == 2 and d["fits"] is True
    assert _cli("llama31_8b_to_3b_32k_1xh200", "--gpus", "3")[0] == 2      # 32 does not divide by 3
    assert _cli("tiny_cpu", "kd.topk=3")[0] == 2                             # the schema names the typo


def _read(*over):
    """Training and notes of the 32K recipe with overrides, composed as `megatron-kd train` composes it."""
    from megatron_kd.plan.recipe import from_recipe
    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import to_recipe
    rp = from_recipe(to_recipe(compose("llama31_8b_to_3b_32k_1xh200", ["kd.cache=/dev/null", *over],
                                       save="/dev/null")))
    return rp.training, rp.notes


def test_recipes_plan_the_layers_the_builder_builds(capsys):
    """attention_backend=auto is planned on TE's layers (what auto builds where TE imports: our container) and the
    plan says so and how to plan the other; model.fp8* and model.megatron's fp8 keys pick the FP8 terms."""
    tr, notes = _read()
    assert (tr.spec, tr.fp8, tr.fp8_attention, tr.te_attention) == ("te", None, False, True)
    assert any("model.attention_backend=auto" in n and "model.attention_backend=sdpa" in n for n in notes)
    tr, notes = _read("model.attention_backend=sdpa")
    assert tr.spec == "sdpa" and not any("attention_backend" in n for n in notes)
    assert _read("model.attention_backend=te")[0].spec == "te"
    tr, notes = _read("model.fp8=hybrid")
    assert (tr.spec, tr.fp8, tr.fp8_attention) == ("te", "tensorwise", False)
    assert not any("not modelled" in n or "fp8" in n for n in notes)   # FP8 of a dense model: all modelled
    tr, _ = _read("model.fp8=hybrid", "model.fp8_recipe=delayed", "model.fp8_attention=true")
    assert (tr.fp8, tr.fp8_attention) == ("delayed", True)
    tr, _ = _read("model.fp8=hybrid", "model.fp8_recipe=delayed", "model.megatron.fp8_dot_product_attention=true")
    assert tr.fp8_attention is True                           # the builder lets model.megatron win
    from megatron_kd.errors import RecipeError
    for refused in (["model.fp8_attention=true"],                 # no FP8 layers: training refuses it
                    ["model.fp8=hybrid", "model.fp8_attention=true"]):   # FP8 attention runs delayed only
        with pytest.raises(RecipeError, match="model.fp8_attention=true"):
            _read(*refused)
    capsys.readouterr()
    rc, _ = _cli("gpt_oss_20b_32k_8xh200", "model.fp8=hybrid")    # FP8 is refused for sink / window models
    assert rc == 2 and "model.fp8=null" in capsys.readouterr().err
    assert any("not yet measured" in n for n in _read("model.fp8=hybrid", "model.fp8_recipe=blockwise")[1])
    rc, _ = _cli("llama31_8b_to_3b_32k_1xh200", "model.attention_backend=sdpa", "model.fp8=hybrid")
    assert rc == 2                                            # FP8 exists in TE's layers only
    from megatron_kd.plan.recipe import from_recipe, load_recipe
    g = from_recipe(load_recipe("gpt_oss_20b_32k_8xh200")).training   # sinks: megatron-kd's attention under TE
    assert g.spec == "te" and g.te_attention is False


def test_te_layer_terms_are_the_tensors_te_keeps():
    """Each term of te_layer_activations is the tensor TE / megatron-core keep (sizes written out from the shape,
    plan/memory.py says why each is kept), and no other: a term left out, added or mis-sized fails."""
    from megatron_kd.plan.memory import te_layer_activations
    s = preset("llama-3.2-3b")
    T, h, f, nq, nkv, d = 32768, 3072, 8192, 24, 8, 128
    te = te_layer_activations(s, Layout(), T, False)
    assert te == {
        "norm1 input (residual)": 2 * T * h + 4 * T,          # LayerNormLinear: its input and the fp32 rstd
        "qkv input (norm1 out)": 2 * T * h,                    # its bf16 norm output (the GEMM's input)
        "q, k after fused RoPE": 2 * T * (nq + nkv) * d,
        "v (contiguous copy)": 2 * T * nkv * d,                # not the qkv output: that is freed
        "attention out + softmax stats": 2 * T * nq * d + 4 * T * nq,
        "norm2 input (residual)": 2 * T * h + 4 * T,
        "mlp input (norm2 out)": 2 * T * h,
        "fc1 output": 2 * T * 2 * f,
        "silu(gate), linear + offset": 2 * 2 * T * f,
        "fc2 input": 2 * T * f}
    local = layer_activations(s, Layout(), T, False)
    assert sum(local.values()) - sum(te.values()) == 2 * T * (nq + nkv) * d + 4 * 2 * T * d  # qkv out - v, cos/sin
    fp8 = {"qkv input (norm1 out)": T * h, "mlp input (norm2 out)": T * h, "fc2 input": T * f}  # 1 byte, column-wise
    assert te_layer_activations(s, Layout(), T, False, fp8="tensorwise") == te | fp8    # proj: the original input
    delayed = te | fp8 | {"proj input (FP8 copy)": T * nq * d}
    assert te_layer_activations(s, Layout(), T, False, fp8="delayed") == delayed
    attn = {k: v for k, v in delayed.items() if k not in ("q, k after fused RoPE", "v (contiguous copy)")}
    attn |= {"q, k, v in FP8": T * (nq + 2 * nkv) * d, "attention out + softmax stats": T * nq * d + 4 * T * nq}
    assert te_layer_activations(s, Layout(), T, False, fp8="delayed", fp8_attention=True) == attn
    # blockwise / mxfp8: an activation's FP8 copy carries 1/32 byte of scales per element
    assert te_layer_activations(s, Layout(), T, False, fp8="mxfp8")["fc2 input"] == T * f * (1 + 1 / 32)
    # TP shards the heads and widths, SP the residual stream (the norms' tensors)
    tp = te_layer_activations(s, Layout(tp=2), T, False, fp8="tensorwise")
    assert tp["v (contiguous copy)"] * 2 == te["v (contiguous copy)"] and tp["qkv input (norm1 out)"] == T // 2 * h
    # static: TE caches a row-wise and a transposed FP8 copy of every linear weight (not embedding, output layer)
    per_layer = h * (nq + 2 * nkv) * d + nq * d * h + h * 2 * f + f * h
    p = plan_memory(s, Layout(), Training(seq_len=T, spec="te", fp8="tensorwise"))
    assert p.get("FP8 weight copies") == 2 * 28 * per_layer
    assert plan_memory(s, Layout(), Training(seq_len=T, spec="te")).get("FP8 weight copies") == 0
    with pytest.raises(ValueError):
        plan_memory(s, Layout(), Training(seq_len=T, fp8="tensorwise"))          # FP8 needs TE's layers
    with pytest.raises(ValueError):
        plan_memory(s, Layout(), Training(seq_len=T, spec="te", fp8_attention=True))


def test_te_spec_keeps_megatron_kd_attention_for_sinks():
    """Under TE a sink model keeps megatron-kd's attention (runtime/te_compat): its attention terms stay the local
    spec's, only the norm + linear pairs are TE's (same bytes in bf16)."""
    from megatron_kd.plan.memory import te_layer_activations
    g = preset("gpt-oss-20b")
    T = 4096
    assert te_layer_activations(g, Layout(), T, True, te_attention=False) == layer_activations(g, Layout(), T, True)
    # a recipe's plan says so through Training.te_attention (runtime/te_compat's rule, read in plan/recipe.py)
    a = plan_memory(g, Layout(ep=8, dp=8), Training(seq_len=T, spec="te", recompute="none", te_attention=False))
    b = plan_memory(g, Layout(ep=8, dp=8), Training(seq_len=T, recompute="none"))
    assert a.get("saved activations") == b.get("saved activations")


@pytest.mark.slow
def test_e2e_bench_smoke_runs_train_and_records_the_plan(tmp_path):
    """The end-to-end bench drives `megatron-kd train` (CPU smoke) and puts the planner's peak next to the run."""
    out = tmp_path / "e2e.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "e2e_bench.py"), "--size", "smoke", "--plan",
                        "--runs", "1gpu_offline", "--workdir", str(tmp_path / "w"), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    logs = "".join(f"\n--- {f.name}\n" + f.read_text()[-3000:] for f in sorted((tmp_path / "w").glob("*.log")))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:] + logs
    run = json.loads(out.read_text())["runs"]["1gpu_offline"]
    assert run["rc"] == 0 and run["summary"]["iteration"] == run["summary"]["iters"] == 12
    assert run["plan"]["predicted_peak_gib"] > 0 and run["plan"]["predicted_over_measured"] is None  # CPU: RSS


def test_the_plan_counts_the_sink_attention():
    """GPT-OSS's sink attention keeps its scaled output and fp32 sigmoid beyond SDPA's (plan/attention_bytes.py,
    checked against autograd on the GPU in tests/models/test_gpt_oss_attention.py); recipes with
    softmax_type=learnable plan them."""
    from dataclasses import replace
    from megatron_kd.plan.attention_bytes import attention_activation_bytes
    s = preset("gpt-oss-20b")
    T = 4096
    with_sink = sum(layer_activations(s, Layout(), T, True).values())
    plain = sum(layer_activations(replace(s, attention_sinks=False), Layout(), T, True).values())
    extra = {k: v for k, v in attention_activation_bytes(T, 64, 8, 64, sink=True, window=None).items()
             if k != "attention out + lse"}
    assert with_sink - plain == sum(extra.values()) > 0


@pytest.mark.parametrize("over, error", [
    (["model.attention_backend=TE"], r"^model\.attention_backend='TE': use one of"),
    (["kd=online", "teacher.fp8=fp4"], r"^teacher\.fp8='fp4': use one of"),
    (["kd=online", "teacher.attention_backend=sdpa", "teacher.fp8=hybrid"],
     r"^teacher\.fp8=hybrid runs in Transformer Engine's layers but teacher\.attention_backend=sdpa"),
    (["kd.build_cache=true", "kd.top_k=100", "teacher.fp8_attention=true"], r"^teacher\.fp8_attention=true needs"),
    (["model.fp8=hybrid", "quant.format=fp8"], r"^quant\.format=fp8 with model\.fp8=hybrid: .*set model\.fp8=null"),
])
def test_plan_refuses_the_backend_and_fp8_keys_training_refuses(over, error):
    """What training refuses of the attention backend and FP8 keys, wherever the machine does not matter, is not
    planned: an unknown backend was planned (as the local spec), a teacher's FP8 keys were not read, and FP8 with
    quant.format was planned. The student alone with the same teacher keys but kd.mode=ce still plans."""
    from megatron_kd.errors import RecipeError
    with pytest.raises(RecipeError, match=error):
        _read(*over)
    if over[0].startswith("kd="):
        _read("kd=ce", *over[1:])
