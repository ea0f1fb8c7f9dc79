"""Sparse top-K KL from hidden states: one function, four impls sharing one numerical core (core.py).

dense, chunked, forward_chunked (torch, function.py) and fused (cuBLAS GEMMs + Triton kernels, fused.py), chosen by
name (LossOptions.impl); the fused impl's buffers and logits mode come from a FusedSettings passed in. kd_loss takes
the options as objects (LossOptions, the parallel layout as a VocabLayout); topk_kl_loss is its keyword form.
"""
from ..parallel.vocab import VocabLayout
from .api import kd_loss, topk_kl_loss
from .chunks import ChunkPlan, FusedSettings, chunk_plan, default_chunk_size
from .options import KDLoss, LossOptions

__all__ = ["kd_loss", "topk_kl_loss", "KDLoss", "LossOptions", "VocabLayout", "FusedSettings", "ChunkPlan",
           "chunk_plan", "default_chunk_size"]
