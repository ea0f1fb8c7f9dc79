"""GPT-OSS core attention (models/sink_attention.py, models/attention.py) and recipe fields (recipe/checks.py, models/gpt_oss.py)
on CPU, against a float64 reference and against megatron-core's own DotProductAttention (sinks + window, unfused).
Runs with megatron-core 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12)."""
import pytest
import torch

from dist_utils import run_ranks


def reference(q, k, v, sink, window, scale):
    """float64: softmax over [scores, sink] (the sink column has no value), causal (+ keys i - window .. i)."""
    rep = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(rep, 1) for x in (k, v))
    sc = q.double() @ k.transpose(-1, -2) * scale
    i = torch.arange(q.shape[2], device=q.device)
    keep = i[:, None] >= i[None, :]
    if window is not None:
        keep &= (i[:, None] - i[None, :]) <= window
    sc = sc.masked_fill(~keep, float("-inf"))
    if sink is None:
        return torch.softmax(sc, -1) @ v
    sk = sink.double().view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    return torch.softmax(torch.cat([sc, sk], -1), -1)[..., :-1] @ v


@pytest.mark.parametrize("s,h,hk,window,with_sink", [(37, 6, 2, None, True), (37, 6, 3, 5, True), (50, 4, 4, 0, True),
                                                    (29, 4, 2, 100, True), (33, 4, 1, 7, False)])
def test_sink_attention_matches_float64(s, h, hk, window, with_sink):
    from megatron_kd.models.sink_attention import sink_attention
    g = torch.Generator().manual_seed(s * h + hk)
    q = torch.randn(2, h, s, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, hk, s, 8, generator=g, requires_grad=True) for _ in range(2))
    sink = (2 * torch.randn(h, generator=g)).requires_grad_() if with_sink else None
    x = [t for t in (q, k, v, sink) if t is not None]
    scale = 0.3
    ref = reference(q, k, v, sink, window, scale)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    gr = torch.autograd.grad((ref * dout).sum(), x)
    out = sink_attention(q, k, v, sink, window, scale, impl="math")
    go = torch.autograd.grad((out.double() * dout).sum(), x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(go, gr):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("s,window", [(200, 17), (300, 128), (130, None)])
def test_flex_eager_forward_matches_math(s, window):
    """The FlexAttention path (eager on CPU: forward only) with our block mask gives the math path's output and
    a natural-log lse (the sink formula depends on it)."""
    from megatron_kd.models.sink_attention import sink_attention
    g = torch.Generator().manual_seed(s)
    q = torch.randn(1, 4, s, 16, generator=g)
    k, v = (torch.randn(1, 2, s, 16, generator=g) for _ in range(2))
    sink = torch.randn(4, generator=g)
    a = sink_attention(q, k, v, sink, window, impl="math")
    b = sink_attention(q, k, v, sink, window, impl="flex_eager")
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("s", [128, 200, 515])
@pytest.mark.parametrize("window", [None, 0, 7, 127, 128, 300])
def test_block_mask_equals_create_block_mask(s, window):
    from torch.nn.attention.flex_attention import create_block_mask
    from megatron_kd.models.sink_attention import _mask_mod, block_mask
    ours = block_mask(s, window, "cpu")
    ref = create_block_mask(_mask_mod(window), None, None, s, s, device="cpu")
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)


def _config(tp=1, **kw):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                softmax_type="learnable", window_size=(5, 0), window_attn_skip_freq=2, attention_dropout=0.0,
                hidden_dropout=0.0, use_cpu_initialization=True, tensor_model_parallel_size=tp,
                masked_softmax_fusion=False, activation_func=F.silu)
    base.update(kw)
    return TransformerConfig(**base)


def _cpu_masks():
    """megatron-core's unfused softmax builds its masks on "cuda"; on CPU the same masks on the CPU."""
    import megatron.core.fusions.fused_softmax as fs
    fs.get_default_causal_mask = lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1)
    fs.get_sliding_window_causal_mask = lambda sq, sk, w: ~torch.ones(sq, sk, dtype=torch.bool).triu(
        sk - sq - w[0]).tril(sk - sq + w[1])


def _megatron_vs_ours(rank, world, tp):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import is_layer_window_attention
    from megatron_kd.models.attention import SDPAttention
    from megatron_kd.runtime.cpu_patches import apply_cpu_patches, seed_model_parallel_rng
    apply_cpu_patches()
    _cpu_masks()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    seed_model_parallel_rng(0)
    cfg = _config(tp)
    g = torch.Generator().manual_seed(1)
    s, b = 24, 2
    q = torch.randn(s, b, 4, 8, generator=g)
    k, v = (torch.randn(s, b, 2, 8, generator=g) for _ in range(2))
    sink = torch.randn(4, generator=g)
    lo, hi = rank * 4 // tp, (rank + 1) * 4 // tp
    klo, khi = rank * 2 // tp, (rank + 1) * 2 // tp
    for layer in (1, 2, 3, 4):
        ours = SDPAttention(cfg, layer, AttnMaskType.causal, "self")
        theirs = DotProductAttention(cfg, layer, AttnMaskType.causal, "self")
        assert ours.softmax_offset.shape == theirs.softmax_offset.shape == (4 // tp,)
        assert ours.softmax_offset.tensor_model_parallel and ours.softmax_offset.partition_dim == 0
        assert (ours.window is not None) == is_layer_window_attention((5, 0), 2, layer)
        with torch.no_grad():
            ours.softmax_offset.copy_(sink[lo:hi])
            theirs.softmax_offset.copy_(sink[lo:hi])
        args = (q[:, :, lo:hi].clone().requires_grad_(), k[:, :, klo:khi].clone().requires_grad_(),
                v[:, :, klo:khi].clone().requires_grad_())
        a = ours(*args, None)
        ga = torch.autograd.grad(a.square().sum(), list(args) + [ours.softmax_offset])
        b_ = theirs(*args, None)
        gb = torch.autograd.grad(b_.square().sum(), list(args) + [theirs.softmax_offset])
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    ps.destroy_model_parallel()


def test_module_matches_megatron_dot_product_attention_tp2():
    """Ours vs megatron-core's DotProductAttention (softmax_type=learnable, window_size=(5, 0),
    window_attn_skip_freq=2) on all four layers: outputs and q/k/v/sink gradients, each TP rank's head shard."""
    run_ranks(2, _megatron_vs_ours, 2)


def _single_rank(rank, world):
    _megatron_vs_ours(rank, world, 1)
    _plain_worker(rank, world)
    _refusals(rank, world)


def test_module_tp1_plain_layers_and_refusals():
    """TP=1: as above; layers without sinks or window stay on SDPA with no parameter; CP, a right window,
    attention dropout and KV-cache decoding are refused with the fix named (one process: spawning is slow)."""
    run_ranks(1, _single_rank)


def _plain_worker(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType
    from megatron_kd.models.attention import SDPAttention
    from megatron_kd.runtime.cpu_patches import apply_cpu_patches
    apply_cpu_patches()
    ps.initialize_model_parallel()
    a = SDPAttention(_config(softmax_type="vanilla", window_size=None), 1, AttnMaskType.causal, "self")
    assert not a.sink_path and a.softmax_offset is None and not list(a.parameters())
    b = SDPAttention(_config(softmax_type="vanilla"), 2, AttnMaskType.causal, "self")  # window, skipped layer
    assert not b.sink_path
    c = SDPAttention(_config(softmax_type="vanilla"), 1, AttnMaskType.causal, "self")
    assert c.sink_path and c.softmax_offset is None and c.window == 5
    ps.destroy_model_parallel()


def _refusals(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType
    from megatron_kd.models.attention import SDPAttention
    from megatron_kd.runtime.cpu_patches import apply_cpu_patches
    apply_cpu_patches()
    ps.initialize_model_parallel()
    with pytest.raises(ValueError, match="parallel.cp=1"):
        SDPAttention(_config(context_parallel_size=2), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match=r"\(left, 0\)"):
        SDPAttention(_config(window_size=(5, 3)), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match="attention_dropout"):
        SDPAttention(_config(attention_dropout=0.1), 1, AttnMaskType.causal, "self")
    a = SDPAttention(_config(), 1, AttnMaskType.causal, "self")
    q = torch.randn(4, 1, 4, 8)
    with pytest.raises(ValueError, match="KV-cache"):
        a(q, torch.randn(6, 1, 2, 8), torch.randn(6, 1, 2, 8), None)
    ps.destroy_model_parallel()


def test_recipe_checks():
    from megatron_kd.recipe.schema import ModelConfig, RecipeError
    from megatron_kd.recipe.checks import check_model
    ok = dict(softmax_type="learnable", window_size=[127, 0], window_attn_skip_freq=2, activation="quick_geglu",
              position_embedding_type="yarn", yarn={"rotary_scaling_factor": 32.0})
    check_model(ModelConfig(**ok), "model", 1)
    for bad, match in ((dict(softmax_type="sinks"), "softmax_type"), (dict(window_size=[127, 1]), "window_size"),
                       (dict(window_size=[127]), "window_size"), (dict(yarn={"factor": 32}), "yarn"),
                       (dict(position_embedding_type="yarn", yarn={}), "needs model.yarn"),
                       (dict(window_attn_skip_freq=0), "window_attn_skip_freq")):
        with pytest.raises(RecipeError, match=match):
            check_model(ModelConfig(**{**ok, **bad}), "model", 1)


def test_activation_bytes():
    from megatron_kd.plan.attention_bytes import attention_activation_bytes
    plain = attention_activation_bytes(32768, 64, 8, 64, sink=False, window=None)
    sink = attention_activation_bytes(32768, 64, 8, 64, sink=True, window=127)
    assert sum(plain.values()) == 2 * 32768 * 64 * 64 + 4 * 32768 * 64
    assert sum(sink.values()) - sum(plain.values()) == 2 * 32768 * 64 * 64 + 6 * 32768 * 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention backward)")
def test_gpu_flex_matches_reference_and_saved_bytes():
    """On GPU: compiled FlexAttention path vs the float64 reference (bf16 tolerance), and the bytes autograd saves
    beyond q/k/v equal attention_activation_bytes."""
    from megatron_kd.models.sink_attention import sink_attention
    from megatron_kd.plan.attention_bytes import attention_activation_bytes
    s, h, hk, d = 1024, 8, 2, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, hk, s, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
            for _ in range(2))
    sink = torch.randn(h, device="cuda", generator=g, requires_grad=True)
    for window in (None, 127):
        ref = reference(q, k, v, sink, window, d ** -0.5)
        out = sink_attention(q, k, v, sink, window)
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
    seen, inputs = {}, {t.data_ptr() for t in (q, k, v, sink)}

    def pack(t):
        if t.data_ptr() not in inputs:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sink_attention(q, k, v, sink, 127)
    want = sum(attention_activation_bytes(s, h, hk, d, sink=True, window=127).values())
    got = sum(seen.values()) + out.numel() * out.element_size()  # the scaled output linear_proj saves
    assert abs(got - want) <= 0.02 * want, (got, want, seen)


@pytest.mark.parametrize("recipe,layers,experts", [("gpt_oss_20b", 24, 32), ("gpt_oss_120b", 36, 128)])
def test_recipes_are_the_real_architectures(recipe, layers, experts):
    """recipes/model/gpt_oss_*.yaml carry what Bridge's GPT-OSS mapping makes of the published config.json."""
    transformers = pytest.importorskip("transformers")
    import os
    from omegaconf import OmegaConf
    from megatron_kd.models.gpt_oss import hf_model_fields
    root = os.path.join(os.path.dirname(__file__), "..", "..", "megatron_kd", "recipes", "model")
    base = OmegaConf.load(os.path.join(root, "gpt_oss_20b.yaml"))
    m = OmegaConf.to_container(OmegaConf.merge(base, OmegaConf.load(os.path.join(root, f"{recipe}.yaml"))))
    hf = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts, vocab_size=201088,
                                   hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                   num_key_value_heads=8, head_dim=64, sliding_window=128, num_experts_per_tok=4,
                                   tie_word_embeddings=False, rope_theta=150000)
    want = hf_model_fields(hf)
    assert {k: m.get(k) for k in want} == want
