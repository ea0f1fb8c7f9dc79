"""What a layer's core attention keeps for backward: SDPA's output and log-sum-exp, and what GPT-OSS's sink
attention (models/sink_attention.py) keeps beyond it."""


def attention_activation_bytes(tokens: int, heads: int, kv_heads: int, head_dim: int, *, sink: bool,
                               window, micro_batch: int = 1, elem: int = 2) -> dict:
    """Bytes this core attention keeps for backward in one layer, per rank (heads, kv_heads: this rank's).

    Counts what the attention itself adds beyond its inputs (q and k after RoPE, v: the layer's qkv tensors,
    which the planner already counts) and the context it returns, reshaped for linear_proj. tokens = tokens of
    the micro-batch on this rank. SDPA (no sink, no window): output + fp32 log-sum-exp. Sink/window
    (FlexAttention): the same, plus with a sink the fp32 sigmoid, its copy in the activation dtype and the
    scaled output (the product linear_proj receives). The window changes time, not saved bytes: FlexAttention
    keeps no [s, s] tensor. `window` is accepted for the caller's clarity (and future kernels)."""
    del window, kv_heads
    b, T, n, d = elem, tokens, heads, head_dim
    out = {"attention out + lse": b * T * n * d + 4 * T * n}
    if sink:
        out["sink scale (fp32 sigmoid + copy)"] = 4 * T * n + b * T * n
        out["sink-scaled output"] = b * T * n * d
    return out
