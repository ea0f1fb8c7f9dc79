"""kernels.swiglu / rope / rmsnorm and models.fusions: the teacher forward's fused elementwise steps.

CPU (Triton's interpreter): each kernel against a float64 reference on fresh random inputs (fp32 in, so the
interpreter's own 16-bit casts do not enter). GPU: each kernel against megatron-core's / torch's eager composition
bit for bit (bf16 and fp16, random weights, strided inputs), and a bf16 GPTModel's hidden states with and without
the fusions bit for bit, with a count that the fused kernels really ran."""
import types

import pytest
import torch
import torch.nn.functional as F

from fused_harness import DEV  # noqa: F401  (sets TRITON_INTERPRET first)

from megatron_kd.kernels.rmsnorm import rms_norm_eager  # noqa: E402
from megatron_kd.kernels.rope import rope_eager  # noqa: E402
from megatron_kd.kernels.swiglu import swiglu_eager  # noqa: E402


def rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@pytest.mark.parametrize("seed", range(3))
def test_swiglu_against_float64(seed):
    g = torch.Generator().manual_seed(seed)
    f = int(torch.randint(1, 2600, (1,), generator=g))
    offset = [0.0, 1.0, -0.5][seed]
    x = torch.randn(3, int(torch.randint(1, 6, (1,), generator=g)), 2 * f, generator=g) * 4
    got = swiglu_eager(x.to(DEV), offset).cpu().double()
    a, b = torch.chunk(x.double(), 2, dim=-1)
    want = F.silu(a) * (b + offset)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("strided", [False, True])
def test_rope_against_float64(d, strided):
    g = torch.Generator().manual_seed(d + strided)
    s, b, h = 37, 2, 3
    full = torch.randn(s, b, 2 * h + 1, d, generator=g)
    t = full[:, :, 1:2 * h + 1:2] if strided else full[:, :, :h]  # heads of a split QKV tensor are strided
    freqs = torch.randn(s, 1, 1, d, generator=g) * 3
    got = rope_eager(t.to(DEV), torch.cos(freqs).to(DEV), torch.sin(freqs).to(DEV)).cpu()
    td = t.double()
    want = td * torch.cos(freqs.double()) + rotate_half(td) * torch.sin(freqs.double())
    assert got.is_contiguous() and got.shape == t.shape
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_rms_norm_against_float64(seed):
    g = torch.Generator().manual_seed(seed)
    h = int(torch.randint(1, 3000, (1,), generator=g))
    x = torch.randn(4, 3, h, generator=g) * [0.01, 1.0, 50.0][seed]
    w = torch.randn(h, generator=g)
    got = rms_norm_eager(x.to(DEV), w.to(DEV), 1e-5).cpu().double()
    xd = x.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def _init_parallel():
    from megatron.core import parallel_state
    from megatron_kd.runtime.cpu_patches import apply_cpu_patches, seed_model_parallel_rng
    apply_cpu_patches()
    if not parallel_state.model_parallel_is_initialized():
        if not torch.distributed.is_initialized():
            from dist_utils import free_port
            torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                                 world_size=1)
        parallel_state.initialize_model_parallel()
    seed_model_parallel_rng(3)
    torch.manual_seed(3)


def _random_norms(model):
    with torch.no_grad():  # norms at random gains, so the weight multiply is exercised
        for n, p in model.named_parameters():
            if "layernorm" in n or "final_norm" in n:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.eval()


def _tiny_gpt(device, dtype, **cfg):
    from megatron.core.models.gpt import GPTModel
    from megatron_kd.models.builder import layer_spec
    from megatron_kd.recipe.schema import ModelConfig
    from megatron.core.transformer import TransformerConfig
    _init_parallel()
    config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=352, normalization="RMSNorm", gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True, bf16=dtype == torch.bfloat16,
                               params_dtype=dtype, init_method_std=0.05, **cfg)
    spec = layer_spec(ModelConfig(attention_backend="sdpa", normalization="RMSNorm"))
    model = GPTModel(config, spec, vocab_size=256, max_sequence_length=64, position_embedding_type="rope",
                     parallel_output=True, share_embeddings_and_output_weights=False).to(device)
    return _random_norms(model)


def test_fusions_leave_a_cpu_model_as_it_was():
    """On CPU nothing is fusable: same outputs, and every patched forward and the RoPE function restored."""
    from megatron.core.transformer import attention as mattn
    from megatron_kd.models.fusions import exact_fusions
    model = _tiny_gpt("cpu", torch.float32)
    tok = torch.randint(0, 256, (1, 16))
    pos = torch.arange(16)[None]
    rope = mattn.apply_rotary_pos_emb
    with torch.no_grad():
        want = model(tok, pos, None)
        with exact_fusions(model):
            assert mattn.apply_rotary_pos_emb is not rope
            got = model(tok, pos, None)
    assert torch.equal(got, want)
    assert mattn.apply_rotary_pos_emb is rope
    assert not any("forward" in vars(m) for m in model.modules())


def test_fusions_run_eager_where_a_kernel_cannot_import(monkeypatch):
    """Without Triton (here: the kernel modules failing to import) a forward inside the block is megatron-core's."""
    import sys
    from megatron_kd.models.fusions import exact_fusions
    model = _tiny_gpt("cpu", torch.float32)
    tok, pos = torch.randint(0, 256, (1, 16)), torch.arange(16)[None]
    with torch.no_grad():
        want = model(tok, pos, None)
        for name in ("swiglu", "rope", "rmsnorm"):
            monkeypatch.setitem(sys.modules, f"megatron_kd.kernels.{name}", None)
        with exact_fusions(model):
            got = model(tok, pos, None)
    assert torch.equal(got, want)


def test_nested_overlapping_and_failing_blocks_restore_everything():
    """Blocks on one model nest, blocks on two models overlap in any order, a block left by an exception closes:
    afterwards every module's forward and megatron-core's RoPE function are what they were, and a forward the
    owner had overridden on the instance is kept."""
    from megatron.core.transformer import attention as mattn
    from megatron_kd.models.fusions import exact_fusions
    rope = mattn.apply_rotary_pos_emb
    a, b = _tiny_gpt("cpu", torch.float32), _tiny_gpt("cpu", torch.float32)
    own = a.decoder.final_layernorm
    own.forward = types.MethodType(lambda self, x: x, own)
    with exact_fusions(a):
        with exact_fusions(a):
            pass
        assert sum("forward" in vars(m) for m in a.modules()) > 1  # the outer block's overrides are still there
    first, second = exact_fusions(a), exact_fusions(b)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert getattr(mattn.apply_rotary_pos_emb, "exact_fusion", False)  # b's block is still open
    second.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="inside"):
        with exact_fusions(b):
            raise RuntimeError("inside")
    assert mattn.apply_rotary_pos_emb is rope
    assert [m for m in a.modules() if "forward" in vars(m)] == [own]
    assert not any("forward" in vars(m) for m in b.modules())


@pytest.mark.parametrize("kind", ["swiglu", "rmsnorm", "rope"])
def test_the_probe_refuses_a_kernel_that_rounds_elsewhere(kind, monkeypatch):
    """_agrees compares a kernel with the eager code it replaces on its probe values: a stand-in that is eager
    passes, the same with one bit of one element changed is refused with a warning (on CPU, so the kernels are
    replaced by stand-ins)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron_kd.kernels import rmsnorm, rope, swiglu
    from megatron_kd.models import fusions

    def eager(x, off=0.0):
        a, b = torch.chunk(x, 2, dim=-1)
        return F.silu(a) * (b + off)
    ref = {"swiglu": (swiglu, "swiglu_eager", eager),
           "rmsnorm": (rmsnorm, "rms_norm_eager", lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps)),
           "rope": (rope, "rope_eager", None)}[kind]
    if kind == "rope":
        def rope_ref(t, cos, sin):  # the kernel's contract (cos / sin rounded to t's dtype) through eager code
            return t * cos + torch.cat((-t[..., t.shape[-1] // 2:], t[..., :t.shape[-1] // 2]), -1) * sin
        ref = (rope, "rope_eager", rope_ref)
        assert torch.equal(*[f(torch.ones(2, 1, 1, 8), torch.ones(2, 1, 1, 8) * 0.5)
                             for f in (lambda t, fr: _apply_rotary_pos_emb_bshd(t, fr),
                                       lambda t, fr: rope_ref(t, torch.cos(fr), torch.sin(fr)))])
    mod, name, good = ref

    def flipped(*args, **kw):
        out = good(*args, **kw).clone()
        out.view(-1).view(torch.int16)[5] ^= 1
        return out
    probe = fusions._agrees.__wrapped__
    monkeypatch.setattr(mod, name, good)
    assert probe(kind, torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(mod, name, flipped)
    with pytest.warns(UserWarning, match=f"exact {kind} kernel does not give"):
        assert not probe(kind, torch.device("cpu"), torch.bfloat16)


gpu = pytest.mark.gpu


def _bits(t):
    return t.view(torch.int16)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_equal_eager_bit_for_bit(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    g = torch.Generator(device="cuda").manual_seed(0)
    for scale in (0.3, 3.0, 30.0):
        x = (torch.randn(1024, 2 * 3000, device="cuda", generator=g) * scale).to(dtype)
        a, b = torch.chunk(x, 2, dim=-1)
        for off in (0.0, 1.0):
            assert torch.equal(_bits(swiglu_eager(x, off)), _bits(F.silu(a) * (b + off)))
        h = (torch.randn(2048, 1, 1000, device="cuda", generator=g) * scale).to(dtype)
        w = 1 + 0.3 * torch.randn(1000, device="cuda", generator=g)  # fp32, as megatron-core's local norm
        assert torch.equal(_bits(rms_norm_eager(h, w, 1e-5)), _bits(F.rms_norm(h, (1000,), w, 1e-5)))
    # subnormals of the dtype, zeros of both signs, and values past expf's overflow, as the probe uses
    from megatron_kd.models.fusions import _probe_values
    x = _probe_values(1024 * 2 * 3000, "cuda", dtype, g).view(1024, 2 * 3000)
    a, b = torch.chunk(x, 2, dim=-1)
    for off in (0.0, 1.0):
        assert torch.equal(_bits(swiglu_eager(x, off)), _bits(F.silu(a) * (b + off)))
    h = _probe_values(2048 * 1000, "cuda", dtype, g).view(2048, 1, 1000)
    assert torch.equal(_bits(rms_norm_eager(h, w, 1e-5)), _bits(F.rms_norm(h, (1000,), w, 1e-5)))
    s, d = 2048, 128
    mixed = torch.randn(s, 2, 4, 6 * d, device="cuda", generator=g).to(dtype)
    q, k, _ = torch.split(mixed, [4 * d, d, d], dim=3)
    freqs = torch.randn(s, 1, 1, d, device="cuda", generator=g) * 100
    for t in (q.reshape(s, 2, -1, d), k):
        want = _apply_rotary_pos_emb_bshd(t, freqs)
        got = rope_eager(t, torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype))
        assert torch.equal(_bits(got), _bits(want))
    t = _probe_values(s * 2 * 4 * d, "cuda", dtype, g).view(s, 2, 4, d)
    want = _apply_rotary_pos_emb_bshd(t, freqs)
    assert torch.equal(_bits(rope_eager(t, torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype))), _bits(want))
    # and the fusions' own check passes here, so a model takes the kernels
    from megatron_kd.models.fusions import _agrees
    assert all(_agrees.__wrapped__(kind, torch.device("cuda", torch.cuda.current_device()), dtype)
               for kind in ("swiglu", "rmsnorm", "rope"))


def _gpt_oss_like():
    """GPT-OSS's features on a tiny model, through the project's builder: sinks, a sliding window on every second
    layer, YaRN RoPE (mscale != 1), biased MoE experts with the clamped quick-GEGLU (not fused)."""
    from megatron_kd.models.builder import build_gpt
    from megatron_kd.recipe.schema import ModelConfig, ParallelConfig
    _init_parallel()
    m = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                    ffn_hidden_size=96, softmax_type="learnable", window_size=[15, 0], window_attn_skip_freq=2,
                    activation="quick_geglu", position_embedding_type="yarn", yarn={"rotary_scaling_factor": 32.0},
                    attention_backend="sdpa", normalization="RMSNorm", add_bias_linear=True, num_moe_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=96, moe_grouped_gemm=False)
    return _random_norms(build_gpt(m, ParallelConfig(), 256, 64, "bf16"))


@gpu
@pytest.mark.parametrize("arch", ["llama", "gpt-oss"])
def test_gpt_hidden_states_equal_with_and_without_fusions(arch, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megatron_kd.kernels import rmsnorm, rope, swiglu
    from megatron_kd.models.fusions import exact_fusions
    model = _tiny_gpt("cuda", torch.bfloat16) if arch == "llama" else _gpt_oss_like()
    tok = torch.randint(0, 256, (2, 64), device="cuda")
    pos = torch.arange(64, device="cuda")[None].expand(2, 64)
    from megatron_kd.models.fusions import _agrees
    assert all(_agrees(kind, tok.device, torch.bfloat16) for kind in ("swiglu", "rope", "rmsnorm"))  # probed
    calls = {"swiglu": 0, "rope": 0, "rmsnorm": 0}  # before the spies: the kernels' own check is not counted

    def spy(mod, name, key):
        fn = getattr(mod, name)

        def wrapped(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        monkeypatch.setattr(mod, name, wrapped)
    spy(swiglu, "swiglu_eager", "swiglu")
    spy(rope, "rope_eager", "rope")
    spy(rmsnorm, "rms_norm_eager", "rmsnorm")
    with torch.no_grad():
        want = model(tok, pos, None)
        with exact_fusions(model):
            got = model(tok, pos, None)
    # the norms' weights are fp32: torch's composite; GPT-OSS's clamped GEGLU experts stay megatron-core's
    assert calls == ({"swiglu": 2, "rope": 4, "rmsnorm": 5} if arch == "llama" else {"swiglu": 0, "rope": 4,
                                                                                     "rmsnorm": 5})
    assert torch.equal(_bits(got.to(torch.bfloat16)), _bits(want.to(torch.bfloat16))) and torch.equal(got, want)
