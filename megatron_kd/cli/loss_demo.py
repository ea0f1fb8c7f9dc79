"""`megatron-kd loss-demo`: every loss impl on the same random inputs, with agreement, time and peak memory."""
import argparse
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..loss import topk_kl_loss


class LargestTensor(TorchDispatchMode):
    """Largest tensor any op produced: the figure chunking is about (no [N, V] block)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="megatron-kd loss-demo")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--chunk-size", type=int, default=256)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    h = torch.randn(a.tokens, a.hidden) * 0.5
    w = torch.randn(a.vocab, a.hidden) * 0.05
    t = torch.log_softmax(torch.randn(a.tokens, a.vocab) * 3, -1)
    logp, ids = t.topk(a.topk, -1)
    del t
    print(f"N={a.tokens} V={a.vocab} H={a.hidden} K={a.topk} (CPU, fp32); full logits would be "
          f"{a.tokens * a.vocab * 4 / 2**20:.0f} MiB")
    print(f"{'impl':<16}{'loss':>12}{'ms':>10}{'largest tensor MiB':>20}")
    ref = None
    for impl in ("dense", "chunked", "forward_chunked"):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        t0 = time.perf_counter()
        loss = topk_kl_loss(hh, ww, ids, logp, impl=impl, chunk_size=a.chunk_size)
        loss.backward()
        ms = (time.perf_counter() - t0) * 1e3
        with LargestTensor() as big:  # second pass, so the timing above carries no dispatch overhead
            topk_kl_loss(hh, ww, ids, logp, impl=impl, chunk_size=a.chunk_size).backward()
        ref = loss.item() if ref is None else ref
        print(f"{impl:<16}{loss.item():>12.6f}{ms:>10.1f}{big.bytes / 2**20:>20.1f}")
    return 0
