"""Structural memory check: the chunked impls never allocate a tensor with N x V elements."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_kd import topk_kl_loss
from reference import make_inputs


class LargestAllocation(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


N, V, H, K, CHUNK = 2048, 512, 8, 8, 64


@pytest.mark.parametrize("impl,tail", [("chunked", "none"), ("forward_chunked", "bucket"), ("chunked", "renormalize"),
                                       ("dense", "none")])
def test_no_n_by_v_tensor(impl, tail):
    inp = make_inputs(n_shape=(N,), V=V, H=H, K=K, dtype=torch.float32, seed=0)
    h = inp["hidden"].requires_grad_(True)
    w = inp["weight"].requires_grad_(True)
    with LargestAllocation() as mode:
        loss = topk_kl_loss(h, w, inp["ids"], inp["logp"], labels=inp["labels"], ce_weight=0.5, temperature=2.0,
                            impl=impl, tail=tail, chunk_size=CHUNK)
        loss.backward()
    if impl == "dense":
        assert mode.largest >= N * V  # the check can fail: dense does hold [N, V]
    else:
        assert mode.largest <= CHUNK * V, f"{impl} allocated {mode.largest} elements (> one chunk {CHUNK * V})"
