"""GPT-OSS's architecture features in the recipe schema, mapped onto megatron-core's TransformerConfig.

The same values Megatron-Bridge's GPT-OSS bridge sets on its provider (megatron/bridge/models/gpt_oss), so a
recipe model (random init, `megatron-kd plan`, device runs) and an HF checkpoint loaded through Bridge build the
same network:
- attention sinks: softmax_type=learnable (parameter core_attention.softmax_offset [heads / TP]);
- sliding window on alternate layers: window_size=[W - 1, 0] for HF's sliding_window W, window_attn_skip_freq=2
  (1-based layer n is windowed when n % 2 != 0: HF's layer_types sliding, full, sliding, ...);
- clamped SwiGLU: activation=quick_geglu (gate * sigmoid(1.702 gate)), activation_func_clamp_value=7 (gate
  clamped above, linear half to [-7, 7]), glu_linear_offset=1 (+1 on the linear half);
- YaRN RoPE: position_embedding_type=yarn with `yarn` (megatron-core's yarn_* fields without the prefix;
  Bridge: factor 32, original 4096, beta fast 32 / slow 1);
- router bias (add_bias_linear), softmax after top-k (megatron-core's default moe_router_pre_softmax=false),
  expert biases (add_bias_linear).
This is the GPT-OSS family's `hooks` module (megatron_kd/families/gpt_oss.py): models/builder.py calls
`activation`, `config_kwargs`, `apply_yarn` and `fix_local_moe_spec` of every family's hooks; the family's record
checks these recipe fields.
"""
# Bridge's GPTOSSBridge.provider_bridge (0.6.2) hard-codes these whatever the HF config says.
BRIDGE_YARN = dict(rotary_scaling_factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                   beta_slow=1.0, mscale=None, mscale_all_dim=None, correction_range_round_to_int=False)


def activation(name: str):
    """(activation_func, gated) for GPT-OSS's activation names; None if not one of them."""
    if name == "quick_geglu":
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
        return quick_gelu, True
    return None


def config_kwargs(m) -> dict:
    """TransformerConfig keyword arguments for the GPT-OSS fields of ModelConfig `m` (empty when all are off)."""
    kw = {}
    if m.softmax_type != "vanilla":
        kw["softmax_type"] = m.softmax_type
    if m.window_size is not None:
        kw["window_size"] = tuple(int(x) for x in m.window_size)
        kw["window_attn_skip_freq"] = m.window_attn_skip_freq
    if m.activation_func_clamp_value is not None:
        kw["activation_func_clamp_value"] = float(m.activation_func_clamp_value)
    if m.glu_linear_offset:
        kw["glu_linear_offset"] = float(m.glu_linear_offset)
    return kw


def apply_yarn(config, m) -> None:
    """megatron-core's GPTModel reads the YaRN settings as yarn_* attributes of its config (TransformerConfig
    has no such fields; Bridge's provider does): set them, unset keys at Bridge's GPT-OSS values."""
    if m.position_embedding_type != "yarn":
        return
    for k, default in BRIDGE_YARN.items():
        setattr(config, f"yarn_{k}", (m.yarn or {}).get(k, default))


def hf_model_fields(cfg) -> dict:
    """ModelConfig fields (megatron-kd's recipe names) of a transformers GptOssConfig, as Bridge maps it:
    the architecture a recipe needs to build the same network as the checkpoint (recipes/model/gpt_oss_*.yaml)."""
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    return dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim, normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps,
        activation="quick_geglu", add_bias_linear=True, add_qkv_bias=True, position_embedding_type="yarn",
        rotary_base=int(rope.get("rope_theta", getattr(cfg, "rope_theta", 150000))),
        tie_embeddings=bool(cfg.tie_word_embeddings), num_moe_experts=cfg.num_local_experts,
        moe_router_topk=cfg.num_experts_per_tok, moe_ffn_hidden_size=cfg.intermediate_size,
        softmax_type="learnable", window_size=[cfg.sliding_window - 1, 0], window_attn_skip_freq=2,
        activation_func_clamp_value=7.0, glu_linear_offset=1.0, yarn=dict(BRIDGE_YARN))


_EXPERT_FC2 = []


def _expert_row_linear():
    if _EXPERT_FC2:
        return _EXPERT_FC2[0]
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class ExpertRowParallelLinear(RowParallelLinear):
        """megatron-core's RowParallelLinear for MoE experts (local spec, SequentialMLP). With expert biases at
        EP=1 and expert TP=1, megatron-core returns its (identity) TP all-reduce's input as-is and then adds the
        bias to it in place, which autograd refuses ("Output 0 of _ReduceFromModelParallelRegion is a view and
        is being modified inplace"): GPT-OSS could not train on one GPU. With one rank there is nothing to
        reduce, so the expert path without the reduce (megatron-core's explicit_expert_comm) is the same math."""

        # Bridge's AutoMapping finds the TP layout of an unregistered class from these: row-parallel.
        tensor_model_parallel = True
        partition_dim = 1

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.is_expert and self.skip_bias_add and self.tp_group.size() == 1:
                self.explicit_expert_comm = True

    _EXPERT_FC2.append(ExpertRowParallelLinear)
    return ExpertRowParallelLinear


def fix_local_moe_spec(spec):
    """Local layer spec of a MoE model with biases: experts' linear_fc2 -> ExpertRowParallelLinear (in place)."""
    from ..runtime.te_compat import spec_submodules as _submodules
    mlp = _submodules(spec).mlp
    try:
        experts = _submodules(_submodules(mlp).experts)
    except (AttributeError, KeyError):  # a dense MLP, or a grouped-GEMM expert module
        return spec
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    if getattr(experts, "linear_fc2", None) is RowParallelLinear:
        experts.linear_fc2 = _expert_row_linear()
    return spec
