"""Qwen2 / Qwen2.5: Bridge's Qwen2Bridge maps config.json (q/k/v biases); hf/exact.py carries RoPE and the
sliding window from max_window_layers on (layer_types)."""
from . import Family

FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM",),
)
