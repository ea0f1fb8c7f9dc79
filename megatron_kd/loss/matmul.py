"""The three GEMMs, with fp32 (or fp64) results from low-precision inputs.

On CUDA, torch.mm(..., out_dtype=float32) keeps bf16 tensor-core speed and returns the fp32
accumulator; elsewhere we upcast the operands.
"""
import torch


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if a.dtype == out_dtype and b.dtype == out_dtype:
        return a @ b
    if a.is_cuda and out_dtype == torch.float32 and a.dtype == b.dtype:
        try:
            return torch.mm(a, b, out_dtype=out_dtype)
        except (RuntimeError, TypeError):
            pass
    return a.to(out_dtype) @ b.to(out_dtype)


def logits(h: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """h [C, H] @ w[Vs, H]^T -> [C, Vs] in out_dtype."""
    return _mm(h, w.t(), out_dtype)


def grad_input(dz: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dz [C, Vs] @ w [Vs, H] -> [C, H] in dz's dtype; dz is cast to w's dtype first (tensor cores)."""
    return _mm(dz.to(w.dtype), w, dz.dtype)


def accumulate_grad_weight(acc: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
    """acc[Vs, H] += dz^T @ h, acc stays fp32/fp64 across chunks (never summed in bf16)."""
    acc.add_(_mm(dz.to(h.dtype).t(), h, acc.dtype))
