"""Build Megatron-Core GPTModels (student and teacher) from the recipe's `model` / `teacher` sections.

Layer spec: Transformer Engine's when TE imports (GPU containers), else Megatron's local spec with its core
attention swapped for torch SDPA (flash attention on GPU, so 32K sequences fit without TE). Models with attention
sinks or sliding windows (GPT-OSS) keep megatron-kd's core attention in either spec.
"""
import torch
import torch.nn.functional as F

from .. import families
from ..rules import padded_vocab_size
from ..recipe.fp8 import fp8_kwargs
from ..recipe.schema import ModelConfig, ParallelConfig
from ..runtime.features import spec_backend  # the rule's home (the recipe's checks ask it too)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _activation(name: str):
    for hooks in families.hooks():  # a family's own activations (GPT-OSS: quick_geglu)
        if hooks.activation(name):
            return hooks.activation(name)
    if name == "swiglu":
        return F.silu, True
    if name == "gelu":
        return F.gelu, False
    from megatron.core.activations import squared_relu
    return squared_relu, False


def transformer_config(m: ModelConfig, p: ParallelConfig, precision: str = "fp32", *, cpu_init: bool | None = None):
    """Megatron TransformerConfig for architecture `m` under layout `p`."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from ..runtime.te_compat import bias_activation_fusion_exact
    act, gated = _activation(m.activation)
    cuda = torch.cuda.is_available()
    use_te = spec_backend(m) == "te"
    dtype = DTYPES[precision]
    kw = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups, kv_channels=m.kv_channels,
        normalization=m.normalization, layernorm_epsilon=m.layernorm_epsilon, activation_func=act,
        gated_linear_unit=gated, add_bias_linear=m.add_bias_linear, add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm, init_method_std=m.init_method_std,
        hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=m.num_moe_experts, moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size, moe_grouped_gemm=m.moe_grouped_gemm,
        recompute_granularity=m.recompute_granularity, recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp, context_parallel_size=p.cp,
        # a dense model beside a MoE one (a dense student of a MoE teacher) has no experts to spread
        expert_model_parallel_size=p.ep if m.num_moe_experts else 1,
        expert_tensor_parallel_size=p.etp if m.num_moe_experts else None,
        sequence_parallel=p.sequence_parallel and p.tp > 1,
        bf16=precision == "bf16", fp16=precision == "fp16", params_dtype=dtype, pipeline_dtype=dtype,
        # Our loss_func returns per-token sums; Megatron divides by the global token count in finalize_model_grads.
        calculate_per_token_loss=True,
        use_cpu_initialization=(not cuda) if cpu_init is None else cpu_init,
        deallocate_pipeline_outputs=p.pp > 1,
        gradient_accumulation_fusion=use_te and cuda,
        apply_rope_fusion=use_te and cuda and m.position_embedding_type == "rope",
        bias_activation_fusion=use_te and cuda and m.add_bias_linear,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )
    kw.update(fp8_kwargs(m))
    for hooks in families.hooks():  # each family's features the recipe turns on (GPT-OSS: sinks, window, GLU)
        kw.update(hooks.config_kwargs(m))
    kw.update(m.megatron or {})
    if "bias_activation_fusion" not in (m.megatron or {}):  # decided on the final fields (megatron: may set a clamp)
        from types import SimpleNamespace
        exact = bias_activation_fusion_exact(SimpleNamespace(**kw))
        kw["bias_activation_fusion"] = kw["bias_activation_fusion"] and exact
    config = TransformerConfig(**kw)
    for hooks in families.hooks():  # YaRN (GPT-OSS's): attributes TransformerConfig has no fields for
        hooks.apply_yarn(config, m)
    return config


def layer_backend(model) -> str:
    """Which layer spec built `model` and which kernels compute its forward: te (Transformer Engine's layers, +fp8
    when its FP8 runs, +fp8_attention when its attention does too), sdpa (torch SDPA / FlexAttention core attention)
    or local (megatron-core's own). A teacher's cache records it (two backends agree only to bf16 rounding), and so
    does every checkpoint (checkpoint/spec.py: TE's spec names some weights differently)."""
    # megatron-core's block gives any layer spec a TE final norm where TE imports: the layers' kernels decide. The
    # classes a module derives from count too: ModelOpt's quantized modules are classes of its own made at runtime
    # on top of the layer's class (a quantized TE linear's own class is modelopt.torch.opt.dynamic's).
    names = {c.__module__ for name, mod in model.named_modules() if "final_layernorm" not in name.split(".")
             for c in type(mod).__mro__}
    if any("transformer_engine" in n for n in names):
        fp8 = getattr(model.config, "fp8", None)
        return "te" + ("+fp8" if fp8 else "") + ("+fp8_attention" if fp8 and getattr(
            model.config, "fp8_dot_product_attention", False) else "")
    if any(n.endswith("models.attention") for n in names):
        return "sdpa"
    return "local"


def own_core_attention(spec, core_attention):
    """`spec` (a layer ModuleSpec) with `core_attention` as its self-attention's core attention (in place)."""
    from ..runtime.te_compat import spec_submodules
    spec_submodules(spec_submodules(spec).self_attention).core_attention = core_attention
    return spec


def te_spec(num_experts, moe_grouped_gemm, qk_layernorm, sinks_or_window: bool):
    """megatron-core's TE layer spec, made right for what our models use: sequential experts whose in-place bias
    add TE's linears allow (runtime/te_compat), and for models with attention sinks or sliding windows
    (GPT-OSS) megatron-kd's core attention in place of TE's, whose logits for those models are not
    transformers' (runtime/te_compat); TE's linears, norms, grouped GEMMs and FP8 stay."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from ..runtime.te_compat import fix_te_moe_spec
    spec = fix_te_moe_spec(get_gpt_layer_with_transformer_engine_spec(
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm))
    if sinks_or_window:
        from .attention import SDPAttention
        own_core_attention(spec, SDPAttention)
    return spec


def layer_spec(m: ModelConfig):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from ..runtime.te_compat import te_attention_unverified
    backend = spec_backend(m)
    if backend == "te":
        return te_spec(m.num_moe_experts, m.moe_grouped_gemm, m.qk_layernorm, te_attention_unverified(m))
    spec = get_gpt_layer_local_spec(num_experts=m.num_moe_experts, moe_grouped_gemm=m.moe_grouped_gemm,
                                    qk_layernorm=m.qk_layernorm, normalization=m.normalization)
    if backend == "sdpa":
        from .attention import SDPAttention
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if m.num_moe_experts and m.add_bias_linear:  # expert biases (GPT-OSS) train at EP=1 / expert TP=1
        fix_local_moe_spec(spec)
    return spec


def fix_local_moe_spec(spec):
    """The families' fix-ups of a local MoE layer spec (in place), e.g. experts with biases at expert TP 1."""
    for hooks in families.hooks():
        spec = hooks.fix_local_moe_spec(spec)
    return spec


def build_gpt(m: ModelConfig, p: ParallelConfig, vocab_size: int, seq_length: int, precision: str = "fp32", *,
              pre_process: bool = True, post_process: bool = True, vp_stage=None, config=None):
    """One GPTModel chunk (on the current device). vocab_size is the tokenizer's; Megatron pads it."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    config = config or transformer_config(m, p, precision)
    from ..runtime.te_compat import build_with_te_wgrad_fusion
    kw = {} if vp_stage is None else {"vp_stage": vp_stage}
    model = build_with_te_wgrad_fusion(config, lambda: GPTModel(
        config, layer_spec(m), vocab_size=padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, p.tp),
        max_sequence_length=seq_length, pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=m.tie_embeddings, position_embedding_type=m.position_embedding_type,
        rotary_percent=m.rotary_percent, rotary_base=m.rotary_base, **rope_scaling_kwargs(m), **kw))
    set_rope_scaling(model, m)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def rope_scaling_kwargs(m: ModelConfig) -> dict:
    """GPTModel's Llama 3 RoPE scaling arguments (megatron-core's RotaryEmbedding applies `factor`)."""
    if not m.rope_scaling:
        return {}
    return dict(rope_scaling=True, rope_scaling_factor=float(m.rope_scaling_factor))


def set_rope_scaling(model, m: ModelConfig) -> None:
    """The rest of Llama 3's scaling on a built GPTModel: GPTModel takes no argument for the low / high frequency
    factors and the original length, and uses megatron-core's defaults (Llama-3.1's 1, 4, 8192) for them."""
    if not m.rope_scaling:
        return
    from ..hf.exact import MCORE_LLAMA3, set_llama3_rope
    rest = dict(low_freq_factor=float(m.rope_low_freq_factor), high_freq_factor=float(m.rope_high_freq_factor),
                original_max_position_embeddings=int(m.rope_original_max_position_embeddings))
    if rest != MCORE_LLAMA3:
        set_llama3_rope(model, factor=m.rope_scaling_factor, **rest)


def build_hf_chunks(m: ModelConfig, p: ParallelConfig, seq_length: int, precision: str, load_weights: bool = True):
    """m.hf_path's architecture and weights through Megatron-Bridge (megatron_kd/hf), our layer spec."""
    from ..hf.model import local_layer_spec
    from ..hf.model import open_hf
    from ..runtime.te_compat import te_attention_unverified
    hf = open_hf(m.hf_path, "hf_path")
    backend = spec_backend(m)
    if backend == "te":
        def spec(config, vp_stage=None):
            return te_spec(config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm,
                           te_attention_unverified(config))
    else:
        from .attention import SDPAttention
        local = local_layer_spec(SDPAttention if backend == "sdpa" else None)
        spec = lambda config, vp_stage=None: fix_local_moe_spec(local(config, vp_stage))  # noqa: E731
    recompute = {k: getattr(m, k) for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")}
    return hf.build(
        p, load_weights=load_weights, precision=precision, seq_length=seq_length, layer_spec=spec,
        fused=backend == "te" and torch.cuda.is_available(), make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        overrides={**fp8_kwargs(m), **(m.megatron or {})}, recompute=recompute)


def build_model_chunks(m: ModelConfig, p: ParallelConfig, vocab_size: int, seq_length: int, precision: str):
    """This rank's model chunks (one, or vpp under virtual pipeline), as Megatron-LM's get_model makes them."""
    from megatron.core import parallel_state as ps
    if m.hf_path:
        return build_hf_chunks(m, p, seq_length, precision)
    config = transformer_config(m, p, precision)
    chunks = []
    for vp in range(p.vpp or 1):
        vp_stage = vp if p.vpp else None
        first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunks.append(build_gpt(m, p, vocab_size, seq_length, precision, pre_process=first, post_process=last,
                                vp_stage=vp_stage, config=config))
    return chunks, config


def wrap_float16(chunks, config):
    """bf16/fp16 params with fp32 outputs at the last stage: Megatron's Float16Module."""
    if not (config.bf16 or config.fp16):
        return chunks
    from megatron.core.transformer.module import Float16Module
    return [Float16Module(config, c) for c in chunks]


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers (first chunk of a list)."""
    if isinstance(model, (list, tuple)):
        model = model[0]
    while hasattr(model, "module"):
        model = model.module
    return model
