"""Hugging Face checkpoints in and out through Megatron-Bridge's AutoBridge.

    from megatron_kd.hf import HFModel
    hf = HFModel("/models/Llama-3.1-8B", key="teacher.hf_path")    # checks the directory, needs Bridge
    chunks = hf.build(parallel, precision="bf16", seq_length=32768, layer_spec=spec)  # this rank's shards, weights
    hf.export(chunks, "/out/student_hf")                             # config.json, safetensors, tokenizer files

The architecture is the HF config's, as Bridge's model provider maps it onto a megatron-core TransformerConfig;
the layer spec is the caller's (megatron-kd's local spec + its attention, or TE's). Everything that can be wrong
with a checkpoint (not a checkpoint, an architecture Bridge does not map, a layout its heads / query groups /
experts / layers do not split into, different vocabularies) is checked from config.json before any model is
built: `checks.py`, which needs neither Bridge nor megatron-core.

Importing this package imports neither Megatron-Bridge nor megatron-core; `HFModel` imports Bridge when made.
"""
from .checks import (HFCheckpointError, bridge_available, check_hf_dir, check_layout, check_same_tokenizer,
                     hf_vocab_size,
                     read_hf_config, require_bridge)

__all__ = ["HFCheckpointError", "HFModel", "bridge_available", "check_hf_dir", "check_layout",
           "check_same_tokenizer",
           "hf_vocab_size", "read_hf_config", "require_bridge"]


def __getattr__(name):
    if name == "HFModel":
        from .model import HFModel
        return HFModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
