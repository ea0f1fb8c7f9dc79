"""GPU check of impl="fused" (one GPU): accuracy against float64, then time and peak memory against the
three bf16 GEMMs (and Liger-Kernel's fused linear CE when installed), all in one run. Prints JSON.

  python benchmarks/kernel_gpu_check.py --out benchmarks/results/kernel_gpu_check_h200.json

Every case is wrapped: a failure is recorded and the rest still runs.
"""
import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import gemm_floor, liger, measure, synthetic_teacher  # noqa: E402
from megatron_kd import topk_kl_loss  # noqa: E402
from megatron_kd.kernels import fused, fused_available  # noqa: E402
from megatron_kd.kernels.ops import gemm, rows  # noqa: E402
from megatron_kd.loss.options import LossOptions  # noqa: E402

DEV = torch.device("cuda")


def inputs(n, vocab, hidden, k, wscale=0.02, seed=0):
    torch.manual_seed(seed)
    h = (torch.randn(n, hidden, device=DEV) * 0.5).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device=DEV) * wscale).to(torch.bfloat16).requires_grad_(True)
    ids, logp = synthetic_teacher(n, k, vocab, DEV, seed)
    return h, w, ids, logp, ids[:, 0].long()


def reference(h, w, ids, logp, labels, tail, ce, T):
    """Independent float64 dense reference (plain log_softmax + autograd)."""
    h64 = h.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    z = h64 @ w64.t()
    ids = ids.long()
    p = logp.double().exp()
    lq = torch.log_softmax(z / T, -1)
    lqk = lq.gather(1, ids)
    kl = (p * (logp.double() - lqk)).sum(1)
    if tail == "bucket":
        R = (1 - p.sum(1)).clamp_min(0)
        r = 1 - lqk.exp().sum(1)
        kl = kl + torch.where(R > 0, R * (R.log() - r.log()), 0.0)
    elif tail == "renormalize":
        P = p.sum(1, keepdim=True)
        kl = ((p / P) * ((p / P).log() - torch.log_softmax(lqk, 1))).sum(1)
    loss = T * T * kl
    if ce:
        loss = loss + ce * (-torch.log_softmax(z, -1).gather(1, labels[:, None])[:, 0])
    loss = loss.mean()
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


def rel(a, b):
    a, b = a.double(), b.double()
    return dict(norm=((a - b).norm() / b.norm().clamp_min(1e-300)).item(),
                max=((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item())


def accuracy_case(n, vocab, hidden, k, tail, ce, T, wscale, force_two_pass=False, overlap=False):
    h, w, ids, logp, labels = inputs(n, vocab, hidden, k, wscale)
    if force_two_pass or overlap:
        from megatron_kd.loss.inputs import check_and_flatten
        from megatron_kd.parallel.vocab import VocabShard
        opts = LossOptions(tail=tail, ce_weight=ce, temperature=T, impl="fused")
        shard = VocabShard.build(vocab)
        hh, t, _ = check_and_flatten(h, w, ids, logp, labels, None, opts, vocab)
        loss = fused.fused_topk_kl(hh, w, t, opts, shard, True, force_two_pass=force_two_pass, overlap=overlap,
                                   sub=512 if overlap else None, sup=2048 if overlap else None)
    else:
        loss = topk_kl_loss(h, w, ids, logp, labels=labels, tail=tail, ce_weight=ce, temperature=T, impl="fused")
    loss.backward()
    got = (loss.detach(), h.grad, w.grad)
    ref = reference(h, w, ids, logp, labels, tail, ce, T)
    out = dict(loss=got[0].item(), ref_loss=ref[0].item(),
               loss_rel=abs(got[0].item() - ref[0].item()) / abs(ref[0].item()),
               grad_h_rel=rel(got[1], ref[1]), grad_w_rel=rel(got[2], ref[2]))
    out["pass"] = (out["loss_rel"] <= 1e-3 and out["grad_h_rel"]["norm"] <= 1e-2
                   and out["grad_w_rel"]["norm"] <= 1e-2)
    return out


def fused_run(h, w, ids, logp, **kw):
    def run():
        h.grad = w.grad = None
        topk_kl_loss(h, w, ids, logp, impl="fused", **kw).backward()
    return run


def cuda_ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def components(n, vocab, hidden, k):
    """Each piece of the scaled path alone, scaled up to N tokens: where the time goes."""
    opts = LossOptions()
    C, S = fused.plan_chunks(n, vocab, opts, scaled=True)
    h = torch.randn(S, hidden, device=DEV).bfloat16()
    w = (torch.randn(vocab, hidden, device=DEV) * 0.02).bfloat16()
    z = torch.empty(C, vocab, device=DEV)
    e = torch.empty(S, vocab, device=DEV, dtype=torch.bfloat16)
    acc = torch.zeros(vocab, hidden, device=DEV)
    idx = torch.randint(0, vocab, (C, k), device=DEV, dtype=torch.int32)
    t_gemm = cuda_ms(lambda: gemm.mm_into(h[:C], w.t(), z))
    t_sweep = cuda_ms(lambda: (gemm.mm_into(h[:C], w.t(), z), rows.row_sweep(z, e[:C], rows.slot_gather_mask(z, idx),
                                                                            1.0, False, fused.SLACK))) - t_gemm
    e.normal_()
    t_gh = cuda_ms(lambda: gemm.mm(e, w, torch.float32))
    t_gw = cuda_ms(lambda: gemm.addmm_(acc, e.t(), h))
    sweep_bytes = C * vocab * (4 + 2)
    return dict(sub_chunk=C, super_chunk=S, per_sub_chunk_ms=dict(logits_gemm_fp32=t_gemm, slot_and_sweep=t_sweep),
                per_super_chunk_ms=dict(grad_h_gemm=t_gh, grad_w_addmm_fp32=t_gw),
                sweep_GBps=sweep_bytes / (t_sweep * 1e-3) / 1e9,
                estimated_total_ms=dict(logits=t_gemm * n / C, sweep=t_sweep * n / C, grad_h=t_gh * n / S,
                                        grad_w=t_gw * n / S),
                addmm_path=gemm.addmm_path(),
                sweep_best_config=str(getattr(rows._sweep_tuned, "best_config", None)))


def timing_case(n, vocab, hidden, k, e_mib=None, main_grad=False, baselines=("gemm", "liger"), overlap=None):
    old, old_overlap = fused.E_BYTES, fused.OVERLAP
    if e_mib:
        fused.E_BYTES = e_mib * fused.MIB
    if overlap is not None:
        fused.OVERLAP = overlap
    try:
        res = {}
        h, w, ids, logp, labels = inputs(n, vocab, hidden, k)
        if "gemm" in baselines:
            res["gemm_floor"] = measure(gemm_floor(h, w), warmup=2)
        if main_grad:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=DEV)
            w.megatron_kd_grad_scale = 1.0
        res["fused"] = measure(fused_run(h, w, ids, logp), warmup=2)
        if main_grad:
            del w.main_grad
        if "liger" in baselines:
            try:
                res["liger_fused_linear_ce"] = measure(liger(h, w, labels), warmup=2)
            except Exception as ex:
                res["liger_fused_linear_ce"] = dict(error=f"{type(ex).__name__}: {ex}"[:200])
        if "gemm_floor" in res:
            res["x_floor"] = res["fused"]["ms"] / res["gemm_floor"]["ms"]
        lg = res.get("liger_fused_linear_ce", {})
        if lg.get("peak_gib"):
            res["peak_vs_liger"] = res["fused"]["peak_gib"] / lg["peak_gib"]
        res["chunks"] = fused.plan_chunks(n, vocab, LossOptions(), scaled=True)
        return res
    finally:
        fused.E_BYTES, fused.OVERLAP = old, old_overlap
        gc.collect()
        torch.cuda.empty_cache()


def guarded(name, out, fn, *a, **kw):
    t0 = time.time()
    try:
        out[name] = fn(*a, **kw)
    except Exception as ex:
        out[name] = dict(error=f"{type(ex).__name__}: {ex}"[:400], trace=traceback.format_exc()[-1500:])
    out[name]["wall_s"] = round(time.time() - t0, 1) if isinstance(out[name], dict) else None
    print(json.dumps({name: out[name]}, default=str), flush=True)
    gc.collect()
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="accuracy + one timing case only")
    a = ap.parse_args()
    env = dict(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), torch=torch.__version__,
               python=platform.python_version(), gpu=torch.cuda.get_device_name(0), fused_available=fused_available())
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    res = dict(env=env)
    print(json.dumps(env), flush=True)
    V, H, K = 128256, 3072, 100
    for tail, ce, T, two in [("none", 0.0, 1.0, False), ("none", 0.0, 1.0, True), ("none", 0.5, 1.0, False),
                             ("bucket", 0.5, 2.0, False), ("renormalize", 0.0, 1.0, False)]:
        name = f"accuracy N=4096 V={V} tail={tail} ce={ce} T={T}" + (" two-pass" if two else "")
        guarded(name, res, accuracy_case, 4096, V, H, K, tail, ce, T, 0.02, two)
    guarded("accuracy N=4096 sharp logits (W x10) tail=none ce=0.5", res, accuracy_case, 4096, V, H, K,
            "none", 0.5, 1.0, 0.2)
    guarded("accuracy N=4096 tail=none ce=0 overlap (side-stream sweeps)", res, accuracy_case, 4096, V, H, K,
            "none", 0.0, 1.0, 0.02, False, True)
    guarded(f"components N=32768 V={V}", res, components, 32768, V, H, K)
    guarded(f"timing N=32768 V={V} H={H}", res, timing_case, 32768, V, H, K)
    if not a.quick:
        guarded(f"timing N=32768 V={V} overlap", res, timing_case, 32768, V, H, K, overlap=True, baselines=())
        guarded(f"timing N=32768 V={V} main_grad", res, timing_case, 32768, V, H, K, main_grad=True,
                baselines=())
        for e_mib in (512, 2048):  # default E_MIB is 1024 (fused.DEFAULTS)
            guarded(f"timing N=32768 V={V} E_MIB={e_mib}", res, timing_case, 32768, V, H, K, e_mib=e_mib,
                    baselines=())
        guarded("timing N=32768 V=201088 H=2880", res, timing_case, 32768, 201088, 2880, K)
        guarded("timing N=65536 V=128256", res, timing_case, 65536, V, H, K)
    summary = {}
    for name, r in res.items():
        if name.startswith("accuracy") and isinstance(r, dict):
            summary[name] = r.get("pass", r.get("error"))
        if name.startswith("timing") and isinstance(r, dict):
            summary[name] = dict(x_floor=r.get("x_floor"), fused_ms=r.get("fused", {}).get("ms"),
                                 fused_peak_gib=r.get("fused", {}).get("peak_gib"),
                                 peak_vs_liger=r.get("peak_vs_liger"), error=r.get("error"))
    res["summary"] = summary
    print(json.dumps(dict(summary=summary), indent=1, default=str), flush=True)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
