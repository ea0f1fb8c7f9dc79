"""Llama (1, 2, 3.x): Bridge's LlamaBridge maps config.json; hf/exact.py carries the RoPE scaling it drops."""
from . import Family

_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
          "vocab_size")


def shape(*values, **kw) -> dict:
    """ModelShape keyword arguments from its positional fields (layers, hidden, heads, groups, head dim, ffn,
    vocab)."""
    return {**dict(zip(_SHAPE, values)), **kw}


FAMILY = Family(
    name="llama",
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    shapes={
        "llama-3.2-1b": shape(16, 2048, 32, 8, 64, 8192, 128256, tie_embeddings=True),
        "llama-3.2-3b": shape(28, 3072, 24, 8, 128, 8192, 128256, tie_embeddings=True),
        "llama-3.1-8b": shape(32, 4096, 32, 8, 128, 14336, 128256),
        "llama-3.1-70b": shape(80, 8192, 64, 8, 128, 28672, 128256),
    },
    aliases={"llama32_3b": "llama-3.2-3b", "llama3.2-3b": "llama-3.2-3b", "llama31_8b": "llama-3.1-8b",
             "llama3.1-8b": "llama-3.1-8b", "llama32_1b": "llama-3.2-1b", "llama31_70b": "llama-3.1-70b"},
)
