"""Megatron-Core GPTModels from the recipe: the builder, the attention modules, GPT-OSS features, the output-layer hook."""
