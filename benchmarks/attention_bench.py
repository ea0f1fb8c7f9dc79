"""Causal GQA attention, forward+backward, per torch SDPA backend (one GPU, same run).

Decides which backend our SDPA core attention asks for (model.sdpa_backend): the Llama-3.2-3B head layout
(24 query heads, 8 KV heads, head dim 128), bf16, batch 1. TFLOP/s counts the causal half:
fwd 2 x 2 x s^2/2 x heads x d, backward 2.5x forward.

  python3 benchmarks/attention_bench.py --seqs 8192 32768 --out results/attention_h200.json
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import environment, measure, save  # noqa: E402

BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for s in a.seqs:
        g = torch.Generator(device=dev).manual_seed(s)
        q = torch.randn(1, a.heads, s, a.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, a.kv_heads, s, a.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, a.kv_heads, s, a.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
        do = torch.randn(1, a.heads, s, a.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
        flops = 2 * 2 * s * s / 2 * a.heads * a.head_dim * 3.5
        ref = None
        for name, be in BACKENDS.items():
            for gqa in (True, False):
                qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))

                def run():
                    k2, v2 = kk, vv
                    if not gqa:
                        rep = a.heads // a.kv_heads
                        k2, v2 = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
                    ctx = sdpa_kernel([be]) if be is not None else torch.autocast("cuda", enabled=False)
                    with ctx:
                        o = F.scaled_dot_product_attention(qq, k2, v2, is_causal=True, enable_gqa=gqa)
                    qq.grad = kk.grad = vv.grad = None
                    o.backward(do)
                    return o
                row = dict(seq=s, backend=name, gqa=gqa)
                try:
                    o = run()
                    grads = [t.grad.float() for t in (qq, kk, vv)]
                    if ref is None:
                        ref = (o.float(), grads)
                    row["max_rel_err_vs_first"] = max(
                        float((x - y).norm() / y.norm()) for x, y in zip([o.float()] + grads, [ref[0]] + ref[1]))
                    row.update(measure(run, reps=a.reps))
                    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
                except Exception as e:  # a backend that refuses this layout is a result
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                print(row, flush=True)
                rows.append(row)
    save(a.out, dict(env=environment(), args=vars(a), rows=rows))


if __name__ == "__main__":
    main()
