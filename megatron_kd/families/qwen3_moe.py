"""Qwen3-MoE: Bridge's Qwen3MoEBridge maps config.json (QK-norm, experts, top-k, norm_topk_prob as softmax after
top-k); the sliding window, which Bridge drops, is carried on every layer. Every config.json field is listed: a
field not here is refused by name."""
from . import Family, Weights, mapped, not_forward, only
from .llama import shape

WINDOW = mapped("every layer's window (transformers' Qwen3-MoE windows all layers when use_sliding_window)")
FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM",),
    strict=True,
    fields={
        "head_dim": mapped("kv_channels"),
        "attention_bias": only(False, why="false (Bridge's Qwen3-MoE provider builds q/k/v/o without biases)"),
        "num_experts": mapped(), "num_local_experts": mapped(), "num_experts_per_tok": mapped(),
        "moe_intermediate_size": mapped(), "norm_topk_prob": mapped("moe_router_pre_softmax = not norm_topk_prob"),
        "decoder_sparse_step": only(1, why="1 (every layer MoE; Bridge builds no dense layers between)"),
        "mlp_only_layers": only([], why="[] (every layer MoE; Bridge builds no dense layers)"),
        "intermediate_size": not_forward("the dense MLP width of mlp_only_layers, which must be empty"),
        "router_aux_loss_coef": not_forward("training's load-balancing loss (the recipe's MoE settings)"),
        "output_router_logits": not_forward("training's load-balancing loss (the recipe's MoE settings)"),
        "max_window_layers": not_forward("transformers' Qwen3-MoE forward does not read it"),
        "sliding_window": WINDOW, "use_sliding_window": WINDOW,
    },
    provider_fields="megatron_kd.hf.exact:every_layer_window",
    weights=Weights(mlp=None, experts="mlp.experts."),
    shapes={"qwen3-30b-a3b": shape(48, 2048, 32, 4, 128, 6144, 151936, qk_layernorm=True, num_moe_experts=128,
                                   moe_router_topk=8, moe_ffn_hidden_size=768)},
)
