"""Build the Megatron-Core GPTModel that a ModelShape describes (local spec, no Transformer Engine).

Used by tests/test_plan.py (exact parameter counts, saved-activation bytes on CPU) and by the GPU
benchmarks (benchmarks/plan_validate.py, benchmarks/e2e_3b_bench.py), so that what the plan predicts and
what they measure are the same model. Works with megatron-core 0.16 (CPU here) and 0.19 (GPU machines).

Long sequences without TE need a flash path: megatron_kd.megatron.attention.SDPAttention replaces Megatron's
DotProductAttention (which materializes [b, heads, s, s] scores) by torch's scaled_dot_product_attention.
"""
import inspect

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
    """The project's SDPA core attention (flash path without TE)."""
    from ..megatron.attention import SDPAttention
    return SDPAttention


def transformer_config(shape: ModelShape, layout: Layout = Layout(), *, recompute: str = "full",
                       recompute_layers: int | None = None, bf16: bool = True, cpu: bool = False,
                       swiglu_fusion: bool = False, **overrides):
    """Megatron TransformerConfig of `shape` on `layout` (no dropout, RoPE, no fusions needing TE/apex)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups, kv_channels=shape.kv_channels, ffn_hidden_size=shape.ffn_hidden_size,
        normalization=shape.normalization,
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
        kw.update(num_moe_experts=shape.num_moe_experts, moe_router_topk=shape.moe_router_topk,
                  moe_ffn_hidden_size=shape.moe_ffn_hidden_size, expert_model_parallel_size=layout.ep,
                  expert_tensor_parallel_size=layout.expert_tp, moe_grouped_gemm=False,
                  moe_token_dispatcher_type="allgather" if cpu else "alltoall",
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3)
        if shape.moe_shared_expert_intermediate_size:
            kw["moe_shared_expert_intermediate_size"] = shape.moe_shared_expert_intermediate_size
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
    kw = dict(num_experts=shape.num_moe_experts or None, moe_grouped_gemm=False, qk_layernorm=shape.qk_layernorm)
    params = inspect.signature(get_gpt_layer_local_spec).parameters
    if "normalization" in params:
        kw["normalization"] = shape.normalization
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
                    vocab_size=padded_vocab(shape.vocab_size, layout.tp, layout.vocab_divisible_by),
                    max_sequence_length=max(shape.learned_pos_emb, 1 << 17),
                    pre_process=pre_process, post_process=post_process, parallel_output=True,
                    share_embeddings_and_output_weights=shape.tie_embeddings,
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
    logits: megatron_kd.megatron.hook with an identity head (the model returns it as [b, s, H])."""
    from ..megatron.hook import forward_with_head
    return forward_with_head(model, lambda hidden, weight: hidden, input_ids, position_ids, None).transpose(0, 1)
