"""GPT-OSS attention as pure torch ops (no Megatron): causal GQA attention with learned per-head sinks and a left
sliding window (what it keeps for backward: plan/attention_bytes.py).

The sink is a softmax column with no value: softmax over [scores, sink] = (attention without the sink) *
Z / (Z + e^sink) = out * sigmoid(lse - sink), lse the row's log-sum-exp. On CUDA the attention and its lse come
from FlexAttention (compiled; its block-sparse mask is built from block bounds, without any [s, s] tensor); on
CPU from an explicit masked math path (tests); both feed the same sink formula. Window convention: megatron-core's
window_size=(left, 0): query i sees keys i - left .. i (Hugging Face's sliding_window W is left = W - 1).
Used by models/attention.py (the core-attention module) and benchmarks/attention_bench.py.
"""
import math

import torch

FLEX_BLOCK = 128


def _mask_mod(window):
    if window is None:
        return lambda b, h, qi, ki: qi >= ki
    return lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= window)


def _kv_blocks(keep):
    """[nq, nk] bool -> (counts [1, 1, nq], indices [1, 1, nq, nk]) with each row's kept blocks first."""
    counts = keep.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None].contiguous(), idx[None, None].contiguous()


_BLOCK_MASKS = {}


def block_mask(seq: int, window, device, block: int = FLEX_BLOCK):
    """FlexAttention's BlockMask for causal (+ left window) attention over `seq` tokens, from block bounds alone
    (create_block_mask would evaluate the mask on all s x s pairs). Cached per (seq, window, device)."""
    from torch.nn.attention.flex_attention import BlockMask
    key = (seq, window, str(device), block)
    if key not in _BLOCK_MASKS:
        n = -(-seq // block)
        b = torch.arange(n)
        lo = b * block
        hi = torch.clamp(lo + block - 1, max=seq - 1)
        lo_i, hi_i, lo_j, hi_j = lo[:, None], hi[:, None], lo[None, :], hi[None, :]
        some = lo_j <= hi_i                       # some (i, j) in the block pair has j <= i
        full = hi_j <= lo_i                       # every pair has j <= i
        if window is not None:
            some &= lo_i - hi_j <= window         # the closest pair is inside the window
            full &= hi_i - lo_j <= window         # the farthest pair is too
        whole = (hi - lo == block - 1)            # a block cut by the sequence end is never "full" (as
        full &= whole[:, None] & whole[None, :]   # create_block_mask): the kernel masks it element-wise
        partial = some & ~full
        kv_num, kv_idx = _kv_blocks(partial)
        full_num, full_idx = _kv_blocks(full)
        bm = BlockMask.from_kv_blocks(kv_num.to(device), kv_idx.to(device), full_num.to(device),
                                      full_idx.to(device), BLOCK_SIZE=block, mask_mod=_mask_mod(window),
                                      seq_lengths=(seq, seq))
        _BLOCK_MASKS[key] = bm
    return _BLOCK_MASKS[key]


_COMPILED = {}


def _flex_fn(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention
    if not compiled:
        return flex_attention
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


def _attention_flex(q, k, v, window, scale, compiled):
    fn = _flex_fn(compiled)
    kw = dict(block_mask=block_mask(q.shape[2], window, q.device), scale=scale,
              enable_gqa=q.shape[1] != k.shape[1])
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch < 2.9
        return fn(q, k, v, return_lse=True, **kw)
    out, aux = fn(q, k, v, return_aux=AuxRequest(lse=True), **kw)
    return out, aux.lse


def _attention_math(q, k, v, window, scale):
    """Explicit masked attention in fp32 (CPU tests): output (q's dtype) and the row log-sum-exp (fp32)."""
    rep = q.shape[1] // k.shape[1]
    kf, vf = (x.float().repeat_interleave(rep, dim=1) for x in (k, v))
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    keep = j <= i
    if window is not None:
        keep = keep & (i - j <= window)
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), vf)
    return out.to(q.dtype), lse


def sink_attention(q, k, v, sink=None, window=None, scale=None, impl: str = "auto"):
    """Causal GQA attention with an optional per-head sink and left window.

    q [b, h, s, d], k/v [b, hk, s, d] (h a multiple of hk), sink [h] or None (no sink), window: keys
    i - window .. i, or None (full causal). impl: auto (compiled FlexAttention on CUDA, math on CPU) | flex
    (compiled on CUDA, eager elsewhere) | flex_eager | math. Returns [b, h, s, d] in q's dtype."""
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"sink/window attention runs training and prefill (queries = keys), got {q.shape[2]} "
                         f"queries and {k.shape[2]} keys; KV-cache decoding needs TE attention")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not divide into {k.shape[1]} key/value heads")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if impl == "auto":
        impl = "flex" if q.is_cuda else "math"
    if impl == "math":
        out, lse = _attention_math(q, k, v, window, scale)
    elif impl in ("flex", "flex_eager"):
        out, lse = _attention_flex(q, k, v, window, scale, compiled=impl == "flex" and q.is_cuda)
    else:
        raise ValueError(f"impl={impl!r}: use auto, flex, flex_eager or math")
    if sink is None:
        return out
    keep = torch.sigmoid(lse - sink.float().view(1, -1, 1))    # Z / (Z + e^sink), fp32
    return out * keep.unsqueeze(-1).to(out.dtype)
