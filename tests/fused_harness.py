"""Shared harness of the fused-impl tests: Triton under its CPU interpreter when there is no GPU (set before
triton is first imported), the fused call made directly, and the float64 reference beside it."""
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`
pytest.importorskip("triton")


from megatron_kd.loss import FusedSettings  # noqa: E402
from megatron_kd.loss.fused import fused_topk_kl  # noqa: E402
from megatron_kd.loss.inputs import check_and_flatten  # noqa: E402
from megatron_kd.loss.options import LossOptions  # noqa: E402
from megatron_kd.parallel.vocab import VocabShard  # noqa: E402
from reference import reference_loss  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
TUNE = dict(sub_rows=8, super_rows=16, block=128)  # FusedSettings fields
gpu = pytest.mark.gpu


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _dev(inp):
    return {k: (v.to(DEV) if torch.is_tensor(v) else v) for k, v in inp.items()}


def run_fused(inp, gout=1.0, tune=TUNE, valid_vocab_size=None, **kw):
    """fused_topk_kl called directly (fused_available() needs CUDA); returns (loss, grad_h, grad_w)."""
    inp = _dev(inp)
    h = inp["hidden"].clone().requires_grad_(True)
    w = inp["weight"].clone().requires_grad_(True)
    opts = LossOptions(impl="fused", **kw)
    shard = VocabShard.build(w.shape[0], valid_vocab_size=valid_vocab_size)
    hh, t, lead = check_and_flatten(h, w, inp["ids"], inp["logp"], inp["labels"], inp["loss_mask"], opts,
                                    vocab_size=shard.valid_size, repeated_ids_ok=True)
    out = fused_topk_kl(hh, w, t, opts, shard, True, FusedSettings(**tune))
    out = out.reshape(lead) if opts.reduction == "none" else out
    (out * (gout.to(DEV) if torch.is_tensor(gout) else gout)).sum().backward()
    return out.detach().cpu(), h.grad.cpu(), None if w.grad is None else w.grad.cpu()


def run_ref(inp, gout=1.0, **kw):
    h = inp["hidden"].double().clone().requires_grad_(True)
    w = inp["weight"].double().clone().requires_grad_(True)
    ref = reference_loss(h, w, inp["ids"], inp["logp"].double(), inp["labels"], inp["loss_mask"], **kw)
    (ref * gout).sum().backward()
    return ref.detach(), h.grad, w.grad


def check(inp, tol, gout=1.0, tune=TUNE, **kw):
    got = run_fused(inp, gout, tune, **kw)
    want = run_ref(inp, gout, **kw)
    errs = [rel(a, b) for a, b in zip(got, want)]
    assert max(errs) <= tol, (kw, errs)
    return errs
