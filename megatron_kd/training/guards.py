"""Numerical guards of a training run: NaN / inf in the loss or gradients before an update (nonfinite_step:
train.nonfinite = stop | skip) and in the weights before a checkpoint (check_weights_finite), so NaN weights are
never trained or saved. Every rank decides alike (safety.all_agree_bad).
"""
import math

import torch

from ..errors import RunError
from .safety import all_agree_bad


def _grad_buffers(chunks):
    for c in chunks:
        for b in list(getattr(c, "buffers", []) or []) + list(getattr(c, "expert_parallel_buffers", []) or []):
            if getattr(b, "grad_data", None) is not None:
                yield b.grad_data


def _grads_nonfinite(chunks):
    """A 0-d tensor (on the grads' device), nonzero when any gradient is NaN/inf; no host sync."""
    flags = [(~torch.isfinite(g)).any() for g in _grad_buffers(chunks)]
    return torch.stack(flags).any() if flags else torch.tensor(False)


def nonfinite_step(losses: dict, chunks, t, iteration: int) -> str | None:
    """Before the optimizer step: why this step's loss or gradients are not finite (None when they are). Under
    train.nonfinite=stop this raises, before any weight is touched, so NaN weights are never trained or saved.
    fp16 runs leave gradient overflow to the loss scaler (a skipped step there is normal)."""
    reasons = [f"loss {k} = {v}" for k, v in losses.items() if isinstance(v, float) and not math.isfinite(v)]
    grads_bad = _grads_nonfinite(chunks) if t.precision != "fp16" else False
    if all_agree_bad(grads_bad):
        reasons.append("gradients hold NaN/inf")
    if not reasons:
        return None
    why = ", ".join(reasons)
    if t.nonfinite == "stop":
        clip = ", set train.clip_grad > 0 (0: no clipping)" if not t.clip_grad else ""
        raise RunError(f"iteration {iteration}: {why}; the run stops before this update (no NaN weights are "
                       f"trained or saved; the last checkpoint is kept): lower train.lr (now {t.lr:g}){clip}, "
                       "or set train.nonfinite=skip to skip such updates")
    return why


def check_weights_finite(chunks, iteration: int) -> None:
    """Before a checkpoint: every weight finite (on every rank), so no NaN weights are ever saved."""
    flags = [(~torch.isfinite(p.data)).any() for c in chunks for p in c.parameters()]
    if all_agree_bad(torch.stack(flags).any() if flags else False):
        raise RunError(f"iteration {iteration}: the weights hold NaN/inf, so no checkpoint is written (the last "
                       "one is kept); lower train.lr or set train.clip_grad > 0 and resume from it")

