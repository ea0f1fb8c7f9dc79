"""The three GEMMs on cuBLAS with fp32 results/accumulators from bf16 operands.

torch.mm / torch.addmm(..., out_dtype=float32) keep tensor-core speed and hand back the fp32
accumulator; they exist on CUDA only (torch >= 2.9) and older releases refuse an fp32 `self` in addmm,
so each entry point falls back (once, then remembers) to a slower exact path. On CPU we upcast.
"""
import torch

_ADDMM_OUT_DTYPE_OK = True
_WGRAD_BLOCK_ROWS = 8192  # fallback: rows of the fp32 accumulator updated per temporary GEMM


def _same(*ts) -> bool:
    return all(t.dtype == ts[0].dtype for t in ts)


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = a @ b, accumulated in (at least) fp32 and written in out's dtype."""
    if _same(a, b, out):
        return torch.mm(a, b, out=out)
    if a.is_cuda and _same(a, b) and out.dtype == torch.float32:
        try:
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        except (RuntimeError, TypeError):
            pass
    return torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


def mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    return mm_into(a, b, out)


def addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> None:
    """acc += alpha * a @ b; acc stays fp32/fp64 (never rounded to bf16 between calls)."""
    global _ADDMM_OUT_DTYPE_OK
    if _same(acc, a, b):
        acc.addmm_(a, b, alpha=alpha)
        return
    if a.is_cuda and _same(a, b) and acc.dtype == torch.float32:
        if _ADDMM_OUT_DTYPE_OK:
            try:
                torch.addmm(acc, a, b, out_dtype=torch.float32, alpha=alpha, out=acc)
                return
            except (RuntimeError, TypeError):
                _ADDMM_OUT_DTYPE_OK = False
        for r in range(0, acc.shape[0], _WGRAD_BLOCK_ROWS):  # bounded fp32 temporaries
            part = mm(a[r:r + _WGRAD_BLOCK_ROWS], b, torch.float32)
            acc[r:r + _WGRAD_BLOCK_ROWS].add_(part, alpha=alpha)
        return
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), alpha=alpha)


def mm_bias_t_into(w: torch.Tensor, h: torch.Tensor, bias: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [V, S] = w [V, H] @ h[S, H]^T + bias[S] per column, accumulated in fp32 and rounded once to out's
    dtype. On CUDA this is cuBLASLt's bias epilogue (torch.addmm with a 1-D bias); elsewhere the same math."""
    if out.is_cuda and _same(w, h, bias, out):
        return torch.addmm(bias, w, h.t(), out=out)
    return out.copy_(torch.addmm(bias.float(), w.float(), h.float().t()))
