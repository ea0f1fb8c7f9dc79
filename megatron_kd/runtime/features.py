"""What this machine offers (Transformer Engine, apex norms), the layer spec a model's attention_backend picks on it,
and freeing a finished run's memory."""
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


def spec_backend(m) -> str:
    """The layer spec a model runs on: te, sdpa or local. `auto` is TE's where TE imports, else sdpa. The one rule:
    the builder builds by it (models/builder), a checkpoint's recorded spec (layer_backend) is compared with it
    before a load (checkpoint/spec.py). `m`: a recipe's model or teacher section (its attention_backend). Here,
    below the recipe, so that the recipe's checks can ask it too; te_available is looked up in this module at call
    time, the one place a test fakes Transformer Engine importing."""
    if m.attention_backend == "auto":
        return "te" if te_available() else "sdpa"
    if m.attention_backend == "te" and not te_available():
        raise RuntimeError("attention_backend=te but Transformer Engine does not import here; use sdpa "
                           "(or auto) or run in a container with TE")
    return m.attention_backend


def release_memory() -> None:
    """Free the finished run's model, gradients and optimizer state now. They sit in reference cycles
    (DDP hooks, Megatron wrappers), which Python frees only when its collector next runs. Without this, a
    second run() in the same process (a sweep, a benchmark arm) starts with the first one's GPU memory still
    allocated (benchmarks/README.md: the HF end-to-end run)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
