"""GPU kernels (Triton). Optional: nothing here is imported unless CUDA and Triton are present."""


def fused_available() -> bool:
    try:
        import torch
        if not torch.cuda.is_available():
            return False
        import triton  # noqa: F401
        from . import fused  # noqa: F401
    except Exception:
        return False
    return True
