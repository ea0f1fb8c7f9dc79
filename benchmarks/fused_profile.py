"""Where the fused loss spends its time (one GPU): torch.profiler kernel table per buffer setting.

  python3 benchmarks/fused_profile.py --out results/fused_profile_h200.json
Each setting: N tokens, forward+backward with the weight gradient into an fp32 main_grad; the table lists
CUDA time by kernel name and the host-side synchronizations (each one idles the GPU between launches).
"""
import argparse
import sys
import time

import torch
from torch.autograd import DeviceType
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
    ap.add_argument("--settings", nargs="+", default=["a768", "512,2048"],
                    help="Z_MIB,E_MIB pairs (fp32 logits) or aMIB (anchored bf16 logits, A_MIB); suffix t: ROWS=torch")
    ap.add_argument("--sweep-tiles", nargs="*", default=[], help="BT,BV,warps[,programs] for a col_sweep timing table")
    ap.add_argument("--trace", default=None, help="write the first setting's Chrome trace here (.json.gz)")
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
        fused.ROWS = "torch" if s.endswith("t") else "kernel"  # suffix t: the per-row bookkeeping in torch ops
        if s.startswith("a"):
            fused.LOGITS, fused.A_BYTES = "anchored", int(s[1:].rstrip("t")) * fused.MIB
        else:
            z, e = (int(x) for x in s.rstrip("t").split(","))
            fused.LOGITS, fused.Z_BYTES, fused.E_BYTES = "fp32", z * fused.MIB, e * fused.MIB
        step()
        torch.cuda.synchronize()
        wall, host = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - t0) * 1e3)  # until the host has queued everything
            torch.cuda.synchronize()
            wall.append((time.perf_counter() - t0) * 1e3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        if a.trace and s == a.settings[0]:
            import gzip
            import os
            import tempfile
            tmp = os.path.join(tempfile.mkdtemp(), "trace.json")
            prof.export_chrome_trace(tmp)
            with open(tmp, "rb") as f, gzip.open(a.trace, "wb") as g:
                g.write(f.read())
        ev = prof.key_averages()
        cuda = sorted(((x.key, x.count, x.device_time_total / 1e3) for x in ev if x.device_time_total > 0),
                      key=lambda r: -r[2])
        syncs = {x.key: x.count for x in ev if "Synchronize" in x.key or "Memcpy" in x.key or "item" in x.key
                 or "nonzero" in x.key or "local_scalar" in x.key}
        total = sum(r[2] for r in cuda)
        rec = dict(kernel_ms_total=total, top=[dict(name=k[:120], count=c, ms=ms) for k, c, ms in cuda[:30]],
                   host_syncs=syncs, kernels=sum(r[1] for r in cuda), wall_ms=sorted(wall)[1],
                   host_ms=sorted(host)[1], gaps=gap_table(prof))
        out["settings"][s] = rec
        print(f"== Z,E = {s}: kernel time {total:.1f} ms over {rec['kernels']} launches; syncs {syncs}")
        print(f"   wall {rec['wall_ms']:.1f} ms, host returns after {rec['host_ms']:.1f} ms; GPU timeline: {rec['gaps']['summary']}")
        for gp in rec["gaps"]["largest"][:8]:
            print(f"   gap {gp['us']:8.1f} us after {gp['after']} before {gp['before']}")
        for r in rec["top"][:22]:
            print(f"  {r['ms']:8.2f} ms  x{r['count']:<5} {r['name']}")
    if a.sweep_tiles:
        out["col_sweep"] = sweep_table(a, dev)
    save(a.out, out)


def gap_table(prof):
    """The GPU timeline of the profiled step: busy time, idle gaps between kernels by size, the largest gaps
    with their neighbours (idle time is where the host, not the GPU, set the pace)."""
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == DeviceType.CUDA)
    if not ks:
        return dict(summary="no device events")
    busy, gaps, end, prev = 0.0, [], ks[0][0], ks[0][2]
    for s0, s1, name in ks:
        if s0 > end:
            gaps.append((s0 - end, prev, name))
        busy += max(0.0, s1 - max(s0, end))
        if s1 > end:
            end, prev = s1, name
    span = end - ks[0][0]
    buckets = {}
    for lo, hi in ((0, 5), (5, 20), (20, 100), (100, 1000), (1000, 1e12)):
        sel = [g[0] for g in gaps if lo <= g[0] < hi]
        buckets[f"{lo}-{hi if hi < 1e12 else 'inf'}us"] = dict(count=len(sel), ms=sum(sel) / 1e3)
    largest = [dict(us=g, after=a[:60], before=b[:60]) for g, a, b in sorted(gaps, reverse=True)[:20]]
    summary = f"span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms in {len(gaps)} gaps"
    return dict(span_ms=span / 1e3, busy_ms=busy / 1e3, idle_ms=(span - busy) / 1e3, buckets=buckets,
                largest=largest, summary=summary, events=len(ks))


def sweep_table(a, dev):
    """ops.cols.col_sweep alone on y^T [V, S] bf16 (S = one anchored super-chunk): ms and GB/s (read + write)."""
    from megatron_kd.kernels.ops import cols
    s = fused.anchored_rows(a.vocab, a.hidden, fused.A_BYTES)
    y = torch.randn(a.vocab, s, device=dev).to(torch.bfloat16)
    rows = []
    for spec in a.sweep_tiles:
        bt, bv, warps, programs = ([int(x) for x in spec.split(",")] + [0])[:4]
        times = []
        for i in range(6):
            y.normal_()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            cols.col_sweep(y, 1.0, bt=bt, bv=bv, warps=warps, programs=programs or None)
            t1.record()
            torch.cuda.synchronize()
            times.append(t0.elapsed_time(t1))
        ms = sorted(times[1:])[2]
        rows.append(dict(bt=bt, bv=bv, warps=warps, programs=programs or cols.PROGRAMS, ms=ms, gbps=4 * y.numel() / ms / 1e6, rows=s))
        print(f"col_sweep BT={bt} BV={bv} warps={warps} programs={programs or cols.PROGRAMS}: {ms:.3f} ms, {rows[-1]['gbps']:.0f} GB/s (S={s})")
    return rows


if __name__ == "__main__":
    main()
