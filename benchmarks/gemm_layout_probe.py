"""Which logits GEMM layout lets the fused loss drop its fp32 logits buffer? (one GPU)

Times, in one run, the per-chunk GEMMs of the fused loss in two layouts:
  rows   z [C, V] fp32 = h_c @ W^T (today), dz [S, V] bf16: grad_h = dz @ W, acc += dz^T @ h
  cols   y^T [V, S] bf16 = W @ h_c^T - b (per-token bias in cuBLASLt's epilogue: y stays small, so bf16 keeps
         it precise), dz^T [V, S] in place: grad_h = (dz^T)^T @ W, acc += dz^T @ h
and checks that the bias is added before the single rounding to bf16.

  python benchmarks/gemm_layout_probe.py --out results/gemm_layout_h200.json
"""
import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import environment, save  # noqa: E402


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[reps // 2]


def probe(n, v, hdim, rows):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    h = (torch.randn(n, hdim, device=dev) * 0.5).bfloat16()
    w = (torch.randn(v, hdim, device=dev) * 0.02).bfloat16()
    out = dict(tokens=n, vocab=v, hidden=hdim)
    floor = {}
    floor["logits"] = timed(lambda: torch.mm(h, w.t()))
    z = torch.mm(h, w.t())
    floor["dgrad"] = timed(lambda: torch.mm(z, w))
    floor["wgrad"] = timed(lambda: torch.mm(z.t(), h))
    del z
    out["floor_ms"] = floor
    acc = torch.zeros(v, hdim, device=dev)
    for s in rows:
        r = {}
        starts = range(0, n - s + 1, s)  # n // s full chunks; times scaled to n tokens below
        zf = torch.empty(min(s, 1024), v, device=dev)
        c = zf.shape[0]

        def rows_logits():
            for c0 in range(0, n, c):
                torch.mm(h[c0:c0 + c], w.t(), out_dtype=torch.float32, out=zf)
        r["rows_logits_fp32_C1024"] = timed(rows_logits)
        del zf
        e = torch.empty(s, v, device=dev, dtype=torch.bfloat16).normal_()
        r["rows_dgrad"] = timed(lambda: [torch.mm(e, w) for c0 in starts])
        r["rows_wgrad"] = timed(lambda: [torch.addmm(acc, e.t(), h[c0:c0 + s], out_dtype=torch.float32, out=acc)
                                         for c0 in starts])
        del e
        et = torch.empty(v, s, device=dev, dtype=torch.bfloat16)
        bias = torch.randn(s, device=dev).bfloat16()
        r["cols_logits_bf16_bias"] = timed(lambda: [torch.addmm(bias, w, h[c0:c0 + s].t(), out=et)
                                                    for c0 in starts])
        r["cols_logits_bf16_nobias"] = timed(lambda: [torch.mm(w, h[c0:c0 + s].t(), out=et)
                                                      for c0 in starts])
        r["cols_dgrad"] = timed(lambda: [torch.mm(et.t(), w) for c0 in starts])
        r["cols_wgrad"] = timed(lambda: [torch.addmm(acc, et, h[c0:c0 + s], out_dtype=torch.float32, out=acc)
                                         for c0 in starts])
        # numerics: y = bf16(fp32(W h^T) - b)? compare with the fp32 product, rounded once
        hs = h[:s]
        b = -(torch.mm(hs.float(), w[:64].float().t()).amax(1)).bfloat16()  # a per-token anchor near the logits
        torch.addmm(b, w, hs.t(), out=et)
        ref = (torch.mm(w.float(), hs.float().t()) + b.float()).bfloat16()
        diff = (et.float() - ref.float()).abs()
        r["bias_exact_frac"] = float((diff == 0).float().mean())
        r["bias_max_abs_diff"] = float(diff.max())
        r["y_max_abs"] = float(et.float().abs().max())
        del et
        k = n / (len(starts) * s)
        r = {key: (x * k if key.startswith(("rows_dgrad", "rows_wgrad", "cols_")) else x) for key, x in r.items()}
        out[f"S={s}"] = r
        print(n, v, s, {k: round(x, 2) if isinstance(x, float) else x for k, x in r.items()}, flush=True)
    print("floor", floor, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[2048, 3072, 4096])
    a = ap.parse_args()
    res = dict(env=environment(), args=vars(a), cases=[])
    for v, hd in [(128256, 3072), (201088, 2880)]:
        res["cases"].append(probe(32768, v, hd, a.rows))
        save(a.out, res)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
