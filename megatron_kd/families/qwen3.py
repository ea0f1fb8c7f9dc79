"""Qwen3 (dense): Bridge's Qwen3Bridge maps config.json (QK-norm, no q/k/v bias); hf/exact.py carries RoPE and
layer_types (the window from max_window_layers on). Every config.json field is listed: a field not here is
refused by name."""
from . import Family, mapped, only

WINDOW = mapped("hf/exact.py: layer_types (transformers derives it from use_sliding_window, sliding_window and "
                "max_window_layers)")
FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    strict=True,
    fields={
        "head_dim": mapped("kv_channels"), "intermediate_size": mapped(),
        "attention_bias": only(False, why="false (Bridge's Qwen3 provider builds q/k/v/o without biases)"),
        "layer_types": WINDOW, "sliding_window": WINDOW, "use_sliding_window": WINDOW, "max_window_layers": WINDOW,
    },
)
