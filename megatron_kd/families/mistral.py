"""Mistral: Bridge's MistralBridge maps config.json; hf/exact.py carries RoPE and sliding_window on every layer.
Every config.json field is listed: a field not here is refused by name."""
from . import Family, mapped, only

FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    architectures=("MistralForCausalLM",),
    strict=True,
    fields={
        "head_dim": mapped("kv_channels"), "intermediate_size": mapped(),
        "sliding_window": mapped("every layer's window"),
        "layer_types": only(None, why="none (alternating layers are Ministral's, which is not registered)"),
    },
    provider_fields="megatron_kd.hf.exact:every_layer_window",
)
