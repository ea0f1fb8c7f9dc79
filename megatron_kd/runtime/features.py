"""What this machine offers (Transformer Engine, apex norms) and freeing a finished run's memory."""
import gc
import importlib.util

import torch


def te_available() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import megatron.core.extensions.transformer_engine as mcore_te
    except Exception:  # TE present but broken (CUDA/cuDNN mismatch): fall back to the local spec
        return False
    # megatron-core's own verdict: on an ImportError it puts a MagicMock in TE's place
    # and sets HAVE_TE = False, while a stand-in module can still satisfy find_spec above.
    return bool(getattr(mcore_te, "HAVE_TE", False))


def apex_available() -> bool:
    """NVIDIA apex's fused norms (not the unrelated PyPI package named apex)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("apex") is None:
        return False
    try:
        return importlib.util.find_spec("apex.normalization") is not None
    except Exception:
        return False


def release_memory() -> None:
    """Free the finished run's model, gradients and optimizer state now. They sit in reference cycles
    (DDP hooks, Megatron wrappers), which Python frees only when its collector next runs. Without this, a
    second run() in the same process (a sweep, a benchmark arm) starts with the first one's GPU memory still
    allocated (benchmarks/README.md: the HF end-to-end run)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
