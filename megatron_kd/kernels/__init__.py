"""Pure ops of the fused loss: Triton kernels (rows, cols, scaled) and the cuBLAS GEMM helpers (gemm). No autograd,
and nothing else of the package is imported here. Optional: the Triton modules need Triton (and CUDA, or
TRITON_INTERPRET=1 on CPU tensors)."""


def fused_available() -> bool:
    """True when CUDA and Triton are present and the kernels import (impl="auto" then picks "fused")."""
    try:
        import torch
        if not torch.cuda.is_available():
            return False
        import triton  # noqa: F401
        from . import cols, rows, scaled  # noqa: F401
    except Exception:
        return False
    return True
