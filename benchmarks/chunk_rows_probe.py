"""How many tokens per anchored chunk (S) keep the fused loss's GEMMs at the floor's speed? (one GPU)

The anchored path (kernels/anchored.py) runs three GEMMs per chunk of S tokens:
  logits  y^T [V, S] bf16 = W @ h_c^T + bias   (cuBLASLt bias epilogue)
  dgrad   [S, H] fp32 = E [S, V] @ W           (E is y^T's transpose view; dgrad_t: [H, S] = W^T @ y^T)
  wgrad   acc [V, H] fp32 += E^T @ (s h_c)     (read-modify-write of the fp32 accumulator per chunk)
Times each per chunk for several S, scaled to N tokens (ms x N / S), beside the floor's three single GEMMs over
N tokens, in the same run. Wave quantisation of the small [S, H] output and the accumulator's traffic per
chunk depend on S, not only its size.

  python benchmarks/chunk_rows_probe.py --out results/chunk_rows_h200.json
"""
import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import environment, save  # noqa: E402
from gemm_layout_probe import timed  # noqa: E402


def probe(n, v, hdim, rows_list, reps):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    h = (torch.randn(n, hdim, device=dev) * 0.5).bfloat16()
    w = (torch.randn(v, hdim, device=dev) * 0.02).bfloat16()
    floor = dict(logits=timed(lambda: torch.mm(h, w.t()), reps))
    z = torch.mm(h, w.t())
    floor["dgrad"] = timed(lambda: torch.mm(z, w), reps)
    floor["wgrad"] = timed(lambda: torch.mm(z.t(), h), reps)
    del z
    floor["total"] = sum(floor.values())
    acc = torch.zeros(v, hdim, dtype=torch.float32, device=dev)
    out = dict(tokens=n, vocab=v, hidden=hdim, floor=floor, rows={})
    for s in rows_list:
        yt = torch.empty(v, s, dtype=torch.bfloat16, device=dev)
        hs = h[:s]
        bias = torch.randn(s, device=dev).bfloat16()
        k = n / s
        r = dict(logits=timed(lambda: torch.addmm(bias, w, hs.t(), out=yt), reps) * k)
        yt.normal_()
        r["dgrad"] = timed(lambda: torch.mm(yt.t(), w, out_dtype=torch.float32), reps) * k
        r["dgrad_t"] = timed(lambda: torch.mm(w.t(), yt, out_dtype=torch.float32), reps) * k  # [H, S] instead
        r["wgrad"] = timed(lambda: torch.addmm(acc, yt, hs, out_dtype=torch.float32, out=acc), reps) * k
        r["total"] = r["logits"] + r["dgrad"] + r["wgrad"]
        r["x_floor"] = r["total"] / floor["total"]
        r["mib"] = v * s * 2 / 2**20
        out["rows"][s] = r
        print(f"V={v} H={hdim} S={s:5d} ({r['mib']:.0f} MiB): logits {r['logits']:.1f} dgrad {r['dgrad']:.1f} "
              f"(dgrad_t {r['dgrad_t']:.1f}) wgrad {r['wgrad']:.1f} = {r['total']:.1f} ms per {n} tokens, {r['x_floor']:.3f}x floor "
              f"({floor['total']:.1f})", flush=True)
        del yt
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--shapes", nargs="+", default=["128256,3072", "201088,2880"])
    ap.add_argument("--rows", type=int, nargs="+",
                    default=[2048, 2304, 2432, 2560, 2592, 2688, 2752, 2816, 2944, 3072, 3328, 4096])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res = dict(env=environment(), args=vars(a), shapes=[])
    for spec in a.shapes:
        v, hdim = (int(x) for x in spec.split(","))
        res["shapes"].append(probe(a.tokens, v, hdim, a.rows, a.reps))
        torch.cuda.empty_cache()
    save(a.out, res)


if __name__ == "__main__":
    main()
