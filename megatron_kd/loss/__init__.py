"""Sparse top-K KL from hidden states: one function, three torch impls sharing one numerical core."""
from .api import topk_kl_loss
from .options import KDLoss, LossOptions

__all__ = ["topk_kl_loss", "KDLoss", "LossOptions"]
