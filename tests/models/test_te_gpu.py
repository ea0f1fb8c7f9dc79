"""Transformer Engine's layer spec through megatron-kd's builder, on a GPU with TE (the NeMo container's stack):
- without apex, a TE model builds with gradient_accumulation_fusion on: TE's linears keep the fusion (they write
  into main_grad), megatron-core's own output layer runs unfused; forward + backward run;
- GPT-OSS's features (sinks, alternate sliding window, YaRN, clamped GLU, biased experts): `auto` builds TE's spec
  with megatron-kd's core attention, experts sequential (the recipe's setting) and grouped, and matches the SDPA
  spec (FlexAttention) on the same weights; TE's own core attention is kept as an expected failure (its logits
  differ), so a TE that reproduces them shows as XPASS;
- FP8 (hybrid, tensorwise): forward + backward under TE, logits near bf16's.
Run on the device: PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -m gpu tests/models/test_te_gpu.py"""
import pytest
import torch

pytestmark = pytest.mark.gpu


def _gpt_oss(backend, grouped, layers=2, dispatcher="allgather"):
    from megatron_kd.recipe.schema import ModelConfig
    return ModelConfig(num_layers=layers, hidden_size=256, ffn_hidden_size=256, num_attention_heads=8,
                       num_query_groups=2, kv_channels=64, normalization="RMSNorm", activation="quick_geglu",
                       activation_func_clamp_value=7.0, glu_linear_offset=1.0, add_bias_linear=True,
                       add_qkv_bias=True, position_embedding_type="yarn", rotary_base=150000,
                       yarn=dict(rotary_scaling_factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=None, mscale_all_dim=None,
                                 correction_range_round_to_int=False),
                       softmax_type="learnable", window_size=[15, 0], window_attn_skip_freq=2, tie_embeddings=False,
                       num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=256, moe_grouped_gemm=grouped,
                       attention_backend=backend, megatron={"moe_token_dispatcher_type": dispatcher})


def _llama(backend, **kw):
    from megatron_kd.recipe.schema import ModelConfig
    return ModelConfig(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_query_groups=4,
                       kv_channels=32, attention_backend=backend, **kw)


def _build(m, seq=128, vocab=512, precision="bf16"):
    from megatron_kd.models.builder import build_gpt
    from megatron_kd.recipe.schema import ParallelConfig
    torch.manual_seed(0)
    return build_gpt(m, ParallelConfig(), vocab, seq, precision)


def _copy_by_shape(src, dst):
    """Copy src's parameters onto dst's, matched by name after TE's fused-norm renames (TE folds the layer norms
    into linear_qkv / linear_fc1 as layer_norm_weight)."""
    import re

    def key(n):  # TE's grouped experts hold expert i's tensors as linear_fc1.weight{i} / bias{i}
        n = re.sub(r"experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)", r"experts.\2.\3\1", n)
        return (n.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
                 .replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"))
    d = dict(dst.named_parameters())
    s = {(n if n in d else key(n)): p for n, p in src.named_parameters()}
    missing = sorted(set(d) - set(s))
    with torch.no_grad():
        for n, p in d.items():
            if n in s:
                p.copy_(s[n].reshape(p.shape))
    return missing


def _main_grads(model):
    """What Megatron's DDP gives every parameter: TE's fused weight-gradient accumulation writes into it."""
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return model


def _logits(model, toks):
    pos = torch.arange(toks.shape[1], device=toks.device).expand_as(toks)
    return model(toks, pos, None).float()


def _spec_difference(ref, te):
    """(max |logit difference| / max |logit|, the tokens): two models on the same random tokens."""
    toks = torch.randint(0, 512, (2, 128), device="cuda")
    with torch.no_grad():
        a, b = _logits(ref, toks), _logits(te, toks)
    return (a - b).abs().max().item() / a.abs().max().item(), toks


def test_te_builds_without_apex_and_keeps_te_wgrad_fusion(mcore_te_gpu):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron_kd.runtime.te_compat import apex_wgrad_available
    m = _build(_llama("te"))
    assert m.config.gradient_accumulation_fusion  # on: TE fuses its own weight-gradient accumulation
    te_lin = [x for x in m.modules() if hasattr(x, "fuse_wgrad_accumulation")]
    assert te_lin and all(x.fuse_wgrad_accumulation for x in te_lin)
    local = [x for x in m.modules() if isinstance(x, (ColumnParallelLinear, RowParallelLinear))]
    assert local  # the output layer
    assert all(x.gradient_accumulation_fusion == apex_wgrad_available() for x in local)
    _main_grads(m)
    toks = torch.randint(0, 512, (1, 128), device="cuda")
    _logits(m, toks).pow(2).mean().backward()
    assert any(p.main_grad.abs().sum() > 0 for p in m.parameters())


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential_experts", "grouped_experts"])
def test_gpt_oss_under_te_matches_the_sdpa_spec_and_trains(mcore_te_gpu, grouped):
    """TE importable, `auto`: GPT-OSS builds TE's spec (TE linears, norms, experts) with megatron-kd's core
    attention; its logits equal the SDPA spec's on the same weights to bf16 rounding; it trains."""
    from megatron_kd.models.attention import SDPAttention
    ref = _build(_gpt_oss("sdpa", False))
    te = _main_grads(_build(_gpt_oss("auto", grouped)))
    assert any("transformer_engine" in type(x).__module__ for x in te.modules())
    assert all(type(layer.self_attention.core_attention) is SDPAttention for layer in te.decoder.layers)
    assert not _copy_by_shape(ref, te)
    err, toks = _spec_difference(ref, te)
    print(f"GPT-OSS TE spec ({'grouped' if grouped else 'sequential'} experts) vs SDPA spec: {err:.3g}")
    assert err < 3e-2, f"TE spec vs SDPA spec logits: max relative difference {err:.3g}"  # bf16 over 2 layers
    out = _logits(te, toks)
    out.pow(2).mean().backward()  # sequential experts: the in-place bias add under TE's linears
    fc2 = {n: p for n, p in te.named_parameters() if "experts" in n and "linear_fc2" in n}
    sinks = [p for n, p in te.named_parameters() if n.endswith("softmax_offset")]
    assert fc2 and sinks
    for n, p in fc2.items():  # biases through autograd (the in-place add), weights fused into main_grad by TE
        g = p.grad if "bias" in n else p.main_grad
        assert g is not None and torch.isfinite(g).all(), n
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in sinks)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])  # alltoall: the GPT-OSS recipes' and Bridge's
@pytest.mark.parametrize("grouped", [False, True], ids=["sequential_experts", "grouped_experts"])
def test_gpt_oss_under_te_with_the_clamp_engaged_matches_the_sdpa_spec_in_fp32(mcore_te_gpu, grouped, dispatcher):
    """Experts' fc1 scaled so the GLU clamp (7.0) engages, fp32: the TE spec keeps megatron-core's fused bias +
    activation off for the clamped GLU (its kernel clamps before adding the bias), so the logits equal the SDPA
    spec's. With the small init alone the clamp never engages and that fusion's error would not show. Both
    dispatchers: the recipes' and Bridge's alltoall and the allgather one."""
    ref = _build(_gpt_oss("sdpa", False, dispatcher=dispatcher), precision="fp32")
    te = _build(_gpt_oss("auto", grouped, dispatcher=dispatcher), precision="fp32")
    assert not _copy_by_shape(ref, te)
    assert not te.config.bias_activation_fusion
    with torch.no_grad():
        for model in (ref, te):
            for n, p in model.named_parameters():
                if "experts" in n and "linear_fc1" in n and "weight" in n:
                    p.mul_(40.0)
    err, toks = _spec_difference(ref, te)
    print(f"GPT-OSS TE spec vs SDPA spec, fp32, clamp engaged ({'grouped' if grouped else 'sequential'}, "
          f"{dispatcher}): {err:.3g}")
    assert err < 5e-3, f"TE spec vs SDPA spec logits (fp32, clamped experts): max relative difference {err:.3g}"


@pytest.mark.xfail(strict=False, reason="TE's own core attention for GPT-OSS (sinks, sliding windows): megatron-kd's "
                                        "TE spec keeps its own core attention for such models until TE's is measured "
                                        "against transformers; an XPASS says the two agree on these weights")
def test_te_core_attention_matches_the_sdpa_spec_for_gpt_oss(mcore_te_gpu, monkeypatch):
    from megatron_kd.runtime import te_compat
    ref = _build(_gpt_oss("sdpa", False))
    monkeypatch.setattr(te_compat, "te_attention_unverified", lambda config: False)  # TE's spec as it is
    te = _build(_gpt_oss("te", False))
    assert not _copy_by_shape(ref, te)
    err, toks = _spec_difference(ref, te)
    print(f"GPT-OSS, TE's core attention vs SDPA spec: {err:.3g}")
    assert err < 3e-2, f"TE's core attention vs SDPA spec logits: max relative difference {err:.3g}"


def test_fp8_trains_and_stays_near_bf16(mcore_te_gpu):
    from megatron.core.fp8_utils import get_fp8_context  # noqa: F401  (megatron-core's FP8 support present)
    ref = _build(_llama("te"), seq=256)
    f8 = _main_grads(_build(_llama("te", fp8="hybrid", fp8_recipe="tensorwise"), seq=256))
    assert f8.config.fp8 == "hybrid"
    assert not _copy_by_shape(ref, f8)
    toks = torch.randint(0, 512, (2, 256), device="cuda")
    a = _logits(ref, toks)
    b = _logits(f8, toks)
    b.pow(2).mean().backward()
    err = (a - b).abs().max().item() / a.abs().max().item()
    assert torch.isfinite(b).all() and 0 < err < 0.25, err  # FP8 differs from bf16, but not wildly


def test_llama_te_spec_top_k_matches_sdpa_spec(mcore_te_gpu):
    """What a cache built by a TE teacher shares with one built by an SDPA teacher of the same weights: the top-K
    ids and their log-probs agree to bf16 rounding (both caches are valid; they are not byte-identical)."""
    ref = _build(_llama("sdpa"), seq=256)
    te = _build(_llama("te"), seq=256)
    assert not _copy_by_shape(ref, te)
    toks = torch.randint(0, 512, (2, 256), device="cuda")
    with torch.no_grad():
        la = torch.log_softmax(_logits(ref, toks), -1)
        lb = torch.log_softmax(_logits(te, toks), -1)
    k = 32
    ia, ib = la.topk(k, -1).indices, lb.topk(k, -1).indices
    top1 = (ia[..., 0] == ib[..., 0]).float().mean().item()
    overlap = torch.tensor([len(set(x.tolist()) & set(y.tolist())) / k
                            for x, y in zip(ia.reshape(-1, k), ib.reshape(-1, k))]).mean().item()
    dlp = (la.gather(-1, ia) - lb.gather(-1, ia)).abs()
    print(f"TE vs SDPA teacher, same weights: top-1 agreement {top1:.4f}, top-{k} id overlap {overlap:.4f}, "
          f"log-prob |diff| mean {dlp.mean().item():.2e} max {dlp.max().item():.2e}")
    assert top1 > 0.9 and overlap > 0.9 and dlp.max().item() < 0.1
