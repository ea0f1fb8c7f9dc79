"""Sparse top-K KL from hidden states: one function, four impls sharing one numerical core (core.py).

dense, chunked, forward_chunked (torch, function.py) and fused (cuBLAS GEMMs + Triton kernels, fused.py), chosen by
name (topk_kl_loss(impl=...)); the fused impl's buffers and logits mode come from a FusedSettings passed in.
"""
from .api import topk_kl_loss
from .chunks import ChunkPlan, FusedSettings, chunk_plan, default_chunk_size
from .options import LossOptions

__all__ = ["topk_kl_loss", "LossOptions", "FusedSettings", "ChunkPlan", "chunk_plan", "default_chunk_size"]
