"""`megatron-kd loss-demo`: every loss impl on the same random inputs, with agreement, time and peak memory.

    megatron-kd loss-demo                      # CPU: dense, chunked, forward_chunked (fp32)
    megatron-kd loss-demo --tokens 32768 --vocab 128256 --hidden 4096   # on a GPU: adds the fused row

The torch impls run on CPU or CUDA. The fused impl (Triton kernels, bf16 logits) needs a CUDA GPU with Triton
installed (`pip install triton`, which CUDA builds of torch bring along); without one its row says so. On a
GPU every impl runs there, in bf16, and memory is the peak CUDA allocation above the inputs; on CPU it is the
largest tensor any op produced (the [tokens x vocab] block chunking avoids).
"""
import argparse
import time


def build_parser():
    ap = argparse.ArgumentParser(prog="megatron-kd loss-demo", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--tokens", type=int, default=4096, help="positions N (default 4096)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary V (default 8192)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size H (default 256)")
    ap.add_argument("--topk", type=int, default=32, help="teacher top-K slots per position (default 32)")
    ap.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk of the chunked impls (default 256)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: CUDA when available (default)")
    return ap


def largest_tensor_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

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

    return LargestTensor()


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    import torch
    from ..kernels import fused_available
    from ..loss import topk_kl_loss
    cuda = torch.cuda.is_available() if a.device == "auto" else a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("megatron-kd loss-demo: error: --device cuda but torch sees no CUDA GPU")
        return 2
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    h = (torch.randn(a.tokens, a.hidden) * 0.5).to(dev, dtype)
    w = (torch.randn(a.vocab, a.hidden) * 0.05).to(dev, dtype)
    t = torch.log_softmax(torch.randn(a.tokens, a.vocab, device=dev) * 3, -1)
    logp, ids = t.topk(a.topk, -1)
    del t
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"N={a.tokens} V={a.vocab} H={a.hidden} K={a.topk} ({name}, {str(dtype).split('.')[1]}); full fp32 "
          f"logits would be {a.tokens * a.vocab * 4 / 2**20:.0f} MiB")
    mem_col = "peak CUDA MiB" if cuda else "largest tensor MiB"
    print(f"{'impl':<16}{'loss':>12}{'ms':>10}{mem_col:>20}")
    impls = ["dense", "chunked", "forward_chunked"]
    if cuda and fused_available():
        impls.append("fused")
    for impl in impls:
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        run = lambda: topk_kl_loss(hh, ww, ids, logp, impl=impl, chunk_size=a.chunk_size)  # noqa: E731
        if cuda:
            run().backward()  # warm-up (Triton compiles on first use)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = run()
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        if cuda:
            mem = (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            with largest_tensor_mode() as big:  # second pass, so the timing above carries no dispatch overhead
                run().backward()
            mem = big.bytes / 2**20
        print(f"{impl:<16}{loss.item():>12.6f}{ms:>10.1f}{mem:>20.1f}")
    if "fused" not in impls:
        why = "no CUDA GPU here" if not torch.cuda.is_available() else (
            "running on CPU (--device cpu)" if not cuda else "Triton is not installed (pip install triton)")
        print(f"{'fused':<16}{'-':>12}{'-':>10}{'-':>20}   needs a CUDA GPU with Triton ({why})")
    return 0
