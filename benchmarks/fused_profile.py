"""Where the fused loss spends its time (one GPU): torch.profiler kernel table per buffer setting.

  python3 benchmarks/fused_profile.py --out results/fused_profile_h200.json
Each setting: N tokens, forward+backward with the weight gradient into an fp32 main_grad; the table lists
CUDA time by kernel name and the host-side synchronizations (each one idles the GPU between launches).
"""
import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import environment, save, synthetic_teacher  # noqa: E402

from megatron_kd import topk_kl_loss  # noqa: E402
from megatron_kd.kernels import fused  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--settings", nargs="+", default=["256,512", "512,2048"], help="Z_MIB,E_MIB pairs")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    h = (torch.randn(a.tokens, a.hidden, device=dev) * 0.5).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(a.vocab, a.hidden, device=dev) * 0.02).to(torch.bfloat16).requires_grad_(True)
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=dev)
    ids, logp = synthetic_teacher(a.tokens, 100, a.vocab, dev)
    out = dict(env=environment(), args=vars(a), settings={})

    def step():
        h.grad = None
        topk_kl_loss(h, w, ids, logp, impl="fused").backward()

    for s in a.settings:
        z, e = (int(x) for x in s.split(","))
        fused.Z_BYTES, fused.E_BYTES = z * fused.MIB, e * fused.MIB
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        ev = prof.key_averages()
        cuda = sorted(((x.key, x.count, x.device_time_total / 1e3) for x in ev if x.device_time_total > 0),
                      key=lambda r: -r[2])
        syncs = {x.key: x.count for x in ev if "Synchronize" in x.key or "Memcpy" in x.key or "item" in x.key
                 or "nonzero" in x.key or "local_scalar" in x.key}
        total = sum(r[2] for r in cuda)
        rec = dict(kernel_ms_total=total, top=[dict(name=k[:120], count=c, ms=ms) for k, c, ms in cuda[:30]],
                   host_syncs=syncs, kernels=sum(r[1] for r in cuda))
        out["settings"][s] = rec
        print(f"== Z,E = {s}: kernel time {total:.1f} ms over {rec['kernels']} launches; syncs {syncs}")
        for r in rec["top"][:22]:
            print(f"  {r['ms']:8.2f} ms  x{r['count']:<5} {r['name']}")
    save(a.out, out)


if __name__ == "__main__":
    main()
