"""Pure ops on tensors and scalars: the fused loss's Triton kernels (rows, cols, scaled) and cuBLAS GEMM helpers (gemm),
lean_adam's step (adam), the top-K's sum-exp (sumexp) and block maxima (blockmax) and the teacher forward's exact
fusions (swiglu, rope, rmsnorm).
No autograd, and nothing else of the package is imported here. Optional: the Triton modules need Triton (and CUDA, or
TRITON_INTERPRET=1 on CPU tensors).
"""
import os

# Launch options of kernels that promise eager torch's bits (swiglu, rope, rmsnorm, sumexp). torch's CUDA build
# neither contracts a multiply and an add into one FMA nor flushes subnormals to zero in libdevice's expf and
# division; Triton does both by default.
EXACT_COMPILE = dict(enable_fp_fusion=False, enable_reflect_ftz=False)


def fused_unavailable(cuda: bool) -> str | None:
    """Why the fused kernels cannot run here (None when they can): said by the loss and the recipe check before
    any work, instead of a ModuleNotFoundError or Triton's "0 active drivers" at the first step."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return ("needs Triton, which does not import here (CUDA builds of torch bring it; pip install triton "
                "otherwise)")
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "needs a CUDA GPU (on CPU only Triton's interpreter runs it, TRITON_INTERPRET=1, for tests)"
    return None


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
