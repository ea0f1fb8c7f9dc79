"""fp16 loss scaling reaches the fused loss: Megatron's schedule multiplies the loss by config.grad_scale_func(1)
before backward, the step reads that scale (optim.loss_scale) and hands it to the loss (KDHead -> topk_kl_loss
grad_scale), so the weight gradient written into main_grad during forward is already scaled and backward does
not rerun the loss. Counts fused.run calls against the float64 reference."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`
pytest.importorskip("triton")
pytest.importorskip("megatron.core")

from megatron_kd.loss import fused  # noqa: E402
from megatron_kd.recipe.schema import KDConfig  # noqa: E402
from megatron_kd.optim.setup import loss_scale  # noqa: E402
from megatron_kd.training.step import KDHead, StepLoss, loss_func  # noqa: E402
from reference import make_inputs, reference_loss  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


class Config:  # the two fields of a TransformerConfig that loss_scale reads
    def __init__(self, fp16, scale):
        self.fp16 = fp16
        self.grad_scale_func = None if scale is None else (lambda x: x * scale)  # optimizer.scale_loss


@pytest.mark.parametrize("fp16,scale,want", [(True, 1024.0, 1024.0), (False, 1.0, 1.0), (True, None, 1.0),
                                             (False, None, 1.0)])
def test_loss_scale_reads_the_schedules_factor(fp16, scale, want):
    assert loss_scale(Config(fp16, scale)) == want
    assert loss_scale(None) == 1.0


def _head_step(monkeypatch, step_scale, backward_scale):
    """KDHead + loss_func as Megatron's schedule runs them (output * grad_scale_func(1), then backward); returns
    (fused.run calls, main_grad error, grad_h error) against float64."""
    s, b, V, H, K = 6, 2, 90, 8, 4
    inp = make_inputs(n_shape=(s * b,), V=V, H=H, K=K, seed=21)
    calls = []
    real = fused.run
    monkeypatch.setattr(fused, "run", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = inp["ids"].reshape(b, s, K).to(DEV)
    logp = inp["logp"].reshape(b, s, K).to(DEV)
    labels = inp["labels"].reshape(b, s).to(DEV)
    mask = torch.ones(b, s, dtype=torch.float64, device=DEV)
    batch = dict(labels=labels, loss_mask=mask, topk_ids=ids, topk_logprobs=logp)
    kd = KDConfig(mode="offline", impl="fused", kl_weight=1.0, ce_weight=0.5)
    head = KDHead(batch, StepLoss.of(kd), V, split=False, grad_scale=step_scale)
    h = inp["hidden"].reshape(b, s, H).transpose(0, 1).contiguous().to(DEV).requires_grad_(True)  # [s, b, H]
    w = inp["weight"].clone().to(DEV).requires_grad_(True)
    w.main_grad = torch.zeros(w.shape, dtype=torch.float64, device=DEV)
    loss, count, _ = loss_func(mask, head, head(h, w))
    (loss * backward_scale).backward()  # Megatron: output_tensor = config.grad_scale_func(output_tensor)
    hh = inp["hidden"].reshape(b, s, H).transpose(0, 1).reshape(-1, H).clone().requires_grad_(True)
    ww = inp["weight"].clone().requires_grad_(True)
    ref = reference_loss(hh, ww, ids.transpose(0, 1).cpu(), logp.transpose(0, 1).cpu(), labels.transpose(0, 1).cpu(),
                         None, ce_weight=0.5, reduction="sum")
    (ref * backward_scale).backward()
    err_w = ((w.main_grad.cpu() - ww.grad).abs().max() / ww.grad.abs().max()).item()
    err_h = ((h.grad.reshape(-1, H).cpu() - hh.grad).abs().max() / hh.grad.abs().max()).item()
    return len(calls), err_w, err_h


@pytest.mark.parametrize("step_scale,backward_scale,runs", [(1024.0, 1024.0, 1), (1.0, 1024.0, 2), (1.0, 1.0, 1)])
def test_loss_scale_reaching_the_loss_avoids_the_rerun(monkeypatch, step_scale, backward_scale, runs):
    """The scale the step hands over matches backward's: one pass. A wrong guess (the scale not passed, as before)
    stays exact but reruns the whole loss."""
    n, err_w, err_h = _head_step(monkeypatch, step_scale, backward_scale)
    assert n == runs
    assert err_w <= 1e-9 and err_h <= 1e-9, (err_w, err_h)
