"""Build the Megatron-Core GPTModel that a ModelShape describes (local spec, no Transformer Engine).

Used by tests/test_plan.py (exact parameter counts, saved-activation bytes on CPU) and by the GPU
benchmarks (benchmarks/plan_validate.py, benchmarks/e2e_3b_bench.py), so that what the plan predicts and
what they measure are the same model. Works with megatron-core 0.16 (CPU here) and 0.19 (GPU machines).

Long sequences without TE need a flash path: `sdpa_core_attention()` replaces Megatron's DotProductAttention
(which materializes [b, heads, s, s] scores) by torch's scaled_dot_product_attention (causal, GQA without
repeating K/V), see sdpa_core_attention(). megatron_kd.megatron's own SDPA module is preferred when it exists (core_attention_class).
"""
import inspect
import math

import torch

from .shapes import Layout, ModelShape, padded_vocab


def megatron_compat() -> None:
    """megatron-core 0.16 without TE: MoE's router references an undefined `te_general_gemm` (0.19 sets None).
    Without CUDA (CPU tests, --smoke): full recompute's checkpoint saves/restores the CUDA RNG state; skip it."""
    try:
        from megatron.core.transformer.moe import moe_utils
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    except Exception:
        pass
    if not torch.cuda.is_available():
        from megatron.core.tensor_parallel import random as mrandom
        if hasattr(mrandom, "_get_cuda_rng_state"):
            mrandom._get_cuda_rng_state = lambda *a, **k: torch.zeros(1, dtype=torch.uint8)
        if hasattr(mrandom, "_set_cuda_rng_state"):
            mrandom._set_cuda_rng_state = lambda *a, **k: None


def core_attention_class():
    """The project's SDPA core attention if megatron_kd.megatron has one, else sdpa_core_attention()."""
    try:  # the integration package's module, when it lands (name guesses kept tolerant on purpose)
        from megatron_kd.megatron import attention as _att  # type: ignore
        for name in ("SDPAttention", "SDPACoreAttention", "SDPAAttention"):
            if hasattr(_att, name):
                return getattr(_att, name)
    except Exception:
        pass
    return sdpa_core_attention()


def _make_sdpa_class():
    from megatron.core.transformer.module import MegatronModule

    class _SDPACoreAttention(MegatronModule):
        """Causal flash attention through torch SDPA; drop-in for Megatron's core_attention submodule.

        Inputs [s, b, heads/tp, d] (query) and [s, b, kv_heads/tp, d] (key, value); output [s, b, heads/tp * d].
        """

        def __init__(self, config, layer_number=1, attn_mask_type=None, attention_type="self",
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None, **kw):
            super().__init__(config=config)
            if getattr(config, "context_parallel_size", 1) != 1:
                raise ValueError("SDPACoreAttention does not implement context parallelism (needs TE)")
            tp = 1
            if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
                tp = pg_collection.tp.size()
            else:
                from megatron.core import parallel_state
                if parallel_state.model_parallel_is_initialized():
                    tp = parallel_state.get_tensor_model_parallel_world_size()
            self.heads = config.num_attention_heads // tp
            self.groups = (config.num_query_groups or config.num_attention_heads) // tp
            self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kw):
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("SDPACoreAttention: packed sequences and attention bias are not supported")
            s, b = query.shape[0], query.shape[1]
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, n, s, d], views
            p = self.dropout if self.training else 0.0
            if self.groups != self.heads:
                try:
                    out = torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, dropout_p=p, is_causal=True, scale=self.scale, enable_gqa=True)
                except (RuntimeError, TypeError):
                    r = self.heads // self.groups
                    out = torch.nn.functional.scaled_dot_product_attention(
                        q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), dropout_p=p, is_causal=True,
                        scale=self.scale)
            else:
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                                       scale=self.scale)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return _SDPACoreAttention


_SDPA = []


def sdpa_core_attention():
    """The SDPACoreAttention class (defined on first use: megatron is imported lazily)."""
    if not _SDPA:
        _SDPA.append(_make_sdpa_class())
    return _SDPA[0]


def transformer_config(shape: ModelShape, layout: Layout = Layout(), *, recompute: str = "full",
                       recompute_layers: int | None = None, bf16: bool = True, cpu: bool = False,
                       swiglu_fusion: bool = False, **overrides):
    """Megatron TransformerConfig of `shape` on `layout` (no dropout, RoPE, no fusions needing TE/apex)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_hidden,
        normalization="RMSNorm" if shape.norm == "rmsnorm" else "LayerNorm",
        gated_linear_unit=shape.gated_mlp,
        activation_func=torch.nn.functional.silu if shape.gated_mlp else torch.nn.functional.gelu,
        add_bias_linear=shape.add_bias_linear, add_qkv_bias=shape.add_qkv_bias, qk_layernorm=shape.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, sequence_parallel=layout.sp,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=cpu, perform_initialization=True,
        bias_activation_fusion=bool(swiglu_fusion and shape.gated_mlp and not shape.add_bias_linear),
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    if shape.is_moe:
        kw.update(num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_topk,
                  moe_ffn_hidden_size=shape.moe_ffn_hidden, expert_model_parallel_size=layout.ep,
                  expert_tensor_parallel_size=layout.expert_tp, moe_grouped_gemm=False,
                  moe_token_dispatcher_type="allgather" if cpu else "alltoall",
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3)
        if shape.moe_shared_ffn:
            kw["moe_shared_expert_intermediate_size"] = shape.moe_shared_ffn
        if shape.moe_layer_freq != 1:
            kw["moe_layer_freq"] = shape.moe_layer_freq
    if recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="block" if recompute_layers is not None
                  else "uniform", recompute_num_layers=recompute_layers if recompute_layers is not None else 1)
    elif recompute == "selective":
        kw.update(recompute_granularity="selective")
    kw.update(overrides)
    fields = set(inspect.signature(TransformerConfig).parameters)
    return TransformerConfig(**{k: v for k, v in kw.items() if k in fields})


def layer_spec(shape: ModelShape, core_attention=None):
    """Megatron's local GPT layer spec (no TE), MoE with SequentialMLP, core attention swapped for SDPA."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    kw = dict(num_experts=shape.num_experts or None, moe_grouped_gemm=False, qk_layernorm=shape.qk_layernorm)
    params = inspect.signature(get_gpt_layer_local_spec).parameters
    if "normalization" in params:
        kw["normalization"] = "RMSNorm" if shape.norm == "rmsnorm" else "LayerNorm"
    spec = get_gpt_layer_local_spec(**{k: v for k, v in kw.items() if k in params or not params})
    if core_attention is not False:
        spec.submodules.self_attention.submodules.core_attention = core_attention or core_attention_class()
    return spec


def build_gpt(shape: ModelShape, layout: Layout = Layout(), config=None, *, core_attention=None,
              pre_process=True, post_process=True, **config_kw):
    """GPTModel of `shape` for this rank (parallel_state must be initialized to `layout`)."""
    from megatron.core.models.gpt import GPTModel
    megatron_compat()
    cfg = config or transformer_config(shape, layout, **config_kw)
    return GPTModel(config=cfg, transformer_layer_spec=layer_spec(shape, core_attention),
                    vocab_size=padded_vocab(shape.vocab, layout.tp, layout.vocab_divisible_by),
                    max_sequence_length=max(shape.learned_pos_emb, 1 << 17),
                    pre_process=pre_process, post_process=post_process, parallel_output=True,
                    share_embeddings_and_output_weights=shape.tied_embeddings,
                    position_embedding_type="learned_absolute" if shape.learned_pos_emb else "rope")


def output_weight(model):
    """The [V/tp, H] weight that produces the logits (the embedding when tied)."""
    m = getattr(model, "module", model)
    while hasattr(m, "module") and not hasattr(m, "output_layer"):
        m = m.module
    if getattr(m, "share_embeddings_and_output_weights", False):
        return m.shared_embedding_or_output_weight()
    return m.output_layer.weight


def hidden_states_forward(model, input_ids, position_ids):
    """Run `model` up to the final layernorm and return its output [s(/tp under SP), b, H], bypassing the
    logits. megatron-core >= 0.19: GPTModel's output_processor hook; older: the output layer is swapped
    for an identity for this call."""
    m = model
    while hasattr(m, "module") and not hasattr(m, "output_layer"):
        m = m.module
    if "output_processor" in inspect.signature(m.forward).parameters:
        return model(input_ids, position_ids, None,
                     output_processor=lambda hidden_states, **_: hidden_states)
    layer = m.output_layer
    orig = layer.forward
    layer.forward = lambda hidden_states, weight=None, runtime_gather_output=None, **_: (hidden_states, None)
    try:
        out = model(input_ids, position_ids, None)  # [b, s, H] (GPTModel transposes logits)
    finally:
        layer.forward = orig
    return out.transpose(0, 1)
