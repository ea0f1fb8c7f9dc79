"""GPT-OSS core attention (megatron_kd/models/sink_attention.py) on one GPU: exactness and 32K cost.

1. check: at 1-4K tokens, our sink attention (compiled FlexAttention + sigmoid(lse - sink)) against an fp32
   eager reference written independently here (softmax over [scores, sink], the sink column carrying no value),
   full-causal and sliding-window layers: output and q/k/v/sink gradients, relative Frobenius error, bf16
   tolerance (rel <= 1e-2; bf16 rounding alone gives about 4e-3).
2. time: at 32K with the GPT-OSS-20B head layout (64 q / 8 kv heads, head dim 64, bf16, batch 1), fwd+bwd
   time and peak memory above the inputs per layer type (full + sink, 128-token window + sink) beside torch
   SDPA causal without sinks, same run. Targets: full + sink <= 1.4x SDPA, window + sink <= 0.1x SDPA.
   Inputs are laid out as Megatron hands them to core attention ([s, b, h, d] permuted) and the output is
   reshaped for linear_proj, as in the module.

  python3 benchmarks/attention_bench.py --out benchmarks/results/attention_gptoss_h200.json   # GPU, ~1-2 min
  python3 benchmarks/attention_bench.py --smoke --out /tmp/attn_smoke.json                    # CPU, tiny
  python3 benchmarks/attention_bench.py --mode sdpa-backends --seqs 8192 32768 --heads 24 --kv-heads 8 \
      --head-dim 128 --out benchmarks/results/attention_h200.json     # the older SDPA backend comparison
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import environment, measure, save  # noqa: E402
from megatron_kd.models.sink_attention import sink_attention  # noqa: E402

TOL = 1e-2


def reference(q, k, v, sink, window, scale):
    """fp32 eager: softmax over [scores, sink] per row, masked causal (+ window), GQA by repetition."""
    rep = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(rep, 1) for x in (k, v))
    sc = (q.float() @ k.transpose(-1, -2)) * scale
    i = torch.arange(q.shape[2], device=q.device)
    keep = i[:, None] >= i[None, :]
    if window is not None:
        keep &= (i[:, None] - i[None, :]) <= window
    sc = sc.masked_fill(~keep, float("-inf"))
    sk = sink.float().view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    p = torch.softmax(torch.cat([sc, sk], -1), -1)[..., :-1]
    return p @ v


def inputs(s, a, dev, dtype, seed):
    """q [b, h, s, d] / k, v [b, hk, s, d] as permuted views of Megatron's [s, b, h, d] tensors, a sink, dout."""
    g = torch.Generator(device=dev).manual_seed(seed)
    mk = lambda h: torch.randn(s, 1, h, a.head_dim, device=dev, dtype=dtype, generator=g).requires_grad_()
    q, k, v = mk(a.heads), mk(a.kv_heads), mk(a.kv_heads)
    sink = torch.randn(a.heads, device=dev, dtype=torch.float32, generator=g).requires_grad_()
    do = torch.randn(s, 1, a.heads * a.head_dim, device=dev, dtype=dtype, generator=g)
    return q, k, v, sink, do


def ours(q, k, v, sink, window, scale, impl):
    perm = lambda x: x.permute(1, 2, 0, 3)
    out = sink_attention(perm(q), perm(k), perm(v), sink, window, scale, impl=impl)
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(a, dev, dtype, impl):
    rows = []
    for s in a.check_seqs:
        q, k, v, sink, do = inputs(s, a, dev, dtype, seed=s)
        scale = a.head_dim ** -0.5
        for layer, window in (("full_sink", None), ("window_sink", a.window - 1)):
            x = (q, k, v, sink)
            r = reference(*(t.permute(1, 2, 0, 3) if t.dim() == 4 else t for t in (q, k, v)), sink, window, scale)
            r = r.permute(2, 0, 1, 3).reshape(s, 1, -1)
            gr = torch.autograd.grad((r * do.float()).sum(), x)
            o = ours(q, k, v, sink, window, scale, impl)
            go = torch.autograd.grad((o.float() * do.float()).sum(), x)
            errs = dict(out=rel(o, r), dq=rel(go[0], gr[0]), dk=rel(go[1], gr[1]), dv=rel(go[2], gr[2]),
                        dsink=rel(go[3], gr[3]))
            row = dict(seq=s, layer=layer, window=window, **errs, ok=max(errs.values()) <= TOL)
            print(row, flush=True)
            rows.append(row)
            del r, gr, o, go
    return rows


def timing(a, dev, dtype, impl):
    cuda = dev.type == "cuda"
    q, k, v, sink, do = inputs(a.seq, a, dev, dtype, seed=1)
    scale = a.head_dim ** -0.5
    s = a.seq

    def sdpa():
        perm = lambda x: x.permute(1, 2, 0, 3)
        o = F.scaled_dot_product_attention(perm(q), perm(k), perm(v), is_causal=True, scale=scale,
                                           enable_gqa=a.heads != a.kv_heads)
        o = o.permute(2, 0, 1, 3).reshape(s, 1, -1)
        q.grad = k.grad = v.grad = None
        o.backward(do)

    def layer(window):
        def run():
            o = ours(q, k, v, sink, window, scale, impl)
            q.grad = k.grad = v.grad = sink.grad = None
            o.backward(do)
        return run

    rows = {}
    for name, fn in (("sdpa_causal_nosink", sdpa), ("full_sink", layer(None)), ("window_sink", layer(a.window - 1))):
        try:
            rows[name] = measure(fn, reps=a.reps, warmup=2)  # warm-up: compile, autotune
        except Exception as e:  # a failing path is a result
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(a.seq, name, rows[name], flush=True)
    ref = rows["sdpa_causal_nosink"].get("ms")
    verdict = {}
    for name, limit in (("full_sink", 1.4), ("window_sink", 0.1)):
        ms = rows[name].get("ms")
        if ref and ms:
            verdict[name] = dict(ratio_vs_sdpa=ms / ref, limit=limit, ok=ms / ref <= limit)
    return dict(seq=s, rows=rows, verdict=verdict)


def gptoss(a):
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    impl = "auto"  # compiled FlexAttention on CUDA, the math path on CPU
    res = dict(env=environment(), args=vars(a), device=str(dev), dtype=str(dtype), tolerance=TOL)
    res["check"] = check(a, dev, dtype, impl)
    res["time"] = timing(a, dev, dtype, impl)
    # the speed verdicts hold for the GPU path (compiled FlexAttention); the CPU math path checks correctness only
    speed_ok = dev.type != "cuda" or all(v["ok"] for v in res["time"]["verdict"].values())
    res["ok"] = all(r["ok"] for r in res["check"]) and speed_ok
    save(a.out, res)
    print(("ALL OK" if res["ok"] else "NOT OK") + ("" if dev.type == "cuda" else " (CPU: correctness only)"),
          flush=True)


def sdpa_backends(a):
    """Causal GQA attention fwd+bwd per torch SDPA backend (decides model.sdpa_backend; Llama-3.2-3B layout)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    dev = torch.device("cuda")
    rows = []
    for s in a.seqs:
        g = torch.Generator(device=dev).manual_seed(s)
        mk = lambda h: torch.randn(1, h, s, a.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
        q, k, v, do = mk(a.heads), mk(a.kv_heads), mk(a.kv_heads), mk(a.heads)
        flops = 2 * 2 * s * s / 2 * a.heads * a.head_dim * 3.5
        ref = None
        for name, be in backends.items():
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
                    row["max_rel_err_vs_first"] = max(rel(x, y) for x, y in zip([o] + grads, [ref[0]] + ref[1]))
                    row.update(measure(run, reps=a.reps, warmup=2))
                    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
                except Exception as e:  # a backend that refuses this layout is a result
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                print(row, flush=True)
                rows.append(row)
    save(a.out, dict(env=environment(), args=vars(a), rows=rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("gptoss", "sdpa-backends"), default="gptoss")
    ap.add_argument("--check-seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--seq", type=int, default=32768, help="timing sequence length (gptoss mode)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768], help="sdpa-backends mode")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=128, help="Hugging Face's sliding_window (left = window - 1)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (checks the script, not the speed)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.mode == "sdpa-backends":
        return sdpa_backends(a)
    if a.smoke:
        a.check_seqs, a.seq, a.heads, a.kv_heads, a.head_dim, a.window, a.reps = [64, 96], 256, 4, 2, 16, 16, 2
    gptoss(a)


if __name__ == "__main__":
    main()
