"""Mistral: Bridge's MistralBridge maps config.json; hf/exact.py carries RoPE and sliding_window on every layer.
Every config.json field is listed: a field not here is refused by name."""
from . import Family, mapped, only

NOT_YARN = "default, linear or llama3 (hf/exact.py); Megatron-Bridge 0.6.2 cannot build Mistral with yarn"


def _not_yarn(rope) -> bool:
    return not (isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) == "yarn")

FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    architectures=("MistralForCausalLM",),
    strict=True,
    fields={
        "head_dim": mapped("kv_channels"), "intermediate_size": mapped(),
        "sliding_window": mapped("every layer's window"),
        "layer_types": only(None, why="none (alternating layers are Ministral's, which is not registered)"),
        # Bridge 0.6.2's MistralBridge fails on YaRN (MistralModelProvider takes no scale_factor)
        "rope_parameters": only(_not_yarn, why=NOT_YARN), "rope_scaling": only(_not_yarn, why=NOT_YARN),
    },
    provider_fields="megatron_kd.hf.exact:every_layer_window",
)
