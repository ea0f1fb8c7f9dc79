"""Loss-only benchmark (one GPU): output projection + sparse top-K KL, forward+backward.

Every row is measured in the same run: the three bf16 GEMMs alone (floor), our impls, Liger-Kernel's fused
linear cross-entropy and Cut Cross-Entropy (CE only: they take no sparse teacher).

  python benchmarks/loss_bench.py --vocab 128256 --hidden 3072 --tokens 8192 32768 65536 262144 --out R.json
"""
import argparse
import gc
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import cce, environment, gemm_floor, liger, measure, save, synthetic_teacher  # noqa: E402

from megatron_kd import topk_kl_loss  # noqa: E402


def ours(h, w, ids, logp, labels, impl, ce_weight=0.0):
    def run():
        h.grad = w.grad = None
        loss = topk_kl_loss(h, w, ids, logp, labels=labels, ce_weight=ce_weight, impl=impl)
        loss.backward()
    return run


def ours_main_grad(h, w, ids, logp):
    """Megatron's gradient-accumulation fusion: the fp32 main_grad buffer exists before the loss runs (DDP
    allocates it), so it counts as an input; the weight gradient lands in it, no second copy."""
    def run():
        if getattr(w, "main_grad", None) is None:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        h.grad = w.grad = None
        w.main_grad.zero_()
        topk_kl_loss(h, w, ids, logp, impl="fused").backward()
    return run


def with_fused(fn, **settings):
    """fn run with module settings of kernels.fused swapped in (e.g. A_BYTES, LOGITS), restored after."""
    from megatron_kd.kernels import fused

    def run():
        old = {k: getattr(fused, k) for k in settings}
        for k, v in settings.items():
            setattr(fused, k, v)
        try:
            fn()
        finally:
            for k, v in old.items():
                setattr(fused, k, v)
    return run


def count_redone():
    """Tokens the anchored path sent back to fp32 logits (kernels/anchored.py), counted per variant."""
    from megatron_kd.kernels import fused
    seen = [0]
    orig = fused._redo_rows

    def spy(rows, *a, **k):
        seen[0] += rows.numel()
        return orig(rows, *a, **k)
    fused._redo_rows = spy
    return seen


def check_agreement(h, w, ids, logp, impls):
    """Loss of every impl at the first few thousand tokens, relative to dense."""
    n = min(h.shape[0], 4096)
    hs, i, lp = h[:n].detach(), ids[:n], logp[:n]
    vals = {impl: topk_kl_loss(hs, w.detach(), i, lp, impl=impl).item() for impl in sorted(set(impls) | {"dense"})}
    ref = vals["dense"]
    return {k: dict(loss=v, rel_to_dense=abs(v - ref) / abs(ref)) for k, v in vals.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 65536, 262144])
    ap.add_argument("--impls", nargs="+", default=["dense", "chunked", "forward_chunked", "fused"])
    ap.add_argument("--baselines", nargs="+", default=["gemm", "liger", "cce"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="passes over all variants; ms = median of all reps")
    ap.add_argument("--anchored-mib", type=int, nargs="*", default=[],
                    help="extra main_grad rows of the fused impl with these anchored buffer sizes")
    ap.add_argument("--fp32-logits", action="store_true", help="also time the fused impl with fp32 logits")
    ap.add_argument("--torch-rows", action="store_true",
                    help="also time the fused impl with the per-row bookkeeping in torch ops (ROWS=torch)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    from megatron_kd.kernels import fused_available
    impls = [i for i in a.impls if i != "fused" or fused_available()]
    rows = []
    result = dict(env=environment(), args=vars(a), rows=rows)
    for n in a.tokens:
        torch.manual_seed(0)
        h = (torch.randn(n, a.hidden, device=dev) * 0.5).to(torch.bfloat16).requires_grad_(True)
        w = (torch.randn(a.vocab, a.hidden, device=dev) * 0.02).to(torch.bfloat16).requires_grad_(True)
        ids, logp = synthetic_teacher(n, a.topk, a.vocab, dev)
        labels = ids[:, 0].long()
        variants = {}
        if "gemm" in a.baselines:
            variants["3 GEMMs alone (floor)"] = gemm_floor(h, w)
        for impl in impls:
            variants[f"ours {impl}"] = ours(h, w, ids, logp, None, impl)
        if "fused" in impls:
            variants["ours fused, grad into main_grad"] = ours_main_grad(h, w, ids, logp)
            for mib in a.anchored_mib:
                variants[f"ours fused A={mib} MiB, grad into main_grad"] = with_fused(
                    ours_main_grad(h, w, ids, logp), A_BYTES=mib << 20)
            if a.torch_rows:
                variants["ours fused, torch row math, grad into main_grad"] = with_fused(
                    ours_main_grad(h, w, ids, logp), ROWS="torch")
            if a.fp32_logits:
                variants["ours fused, fp32 logits (Z/E buffers), grad into main_grad"] = with_fused(
                    ours_main_grad(h, w, ids, logp), LOGITS="fp32")
        if "liger" in a.baselines:
            variants["Liger fused linear CE (CE only)"] = liger(h, w, labels)
        if "cce" in a.baselines:
            variants["Cut Cross-Entropy (CE only)"] = cce(h, w, labels)
        redone = count_redone() if "fused" in impls else [0]
        results = {name: None for name in variants}
        for rnd in range(a.rounds):  # rounds: every variant once per round, so clock drift hits all alike
            for name, fn in variants.items():
                if results[name] is not None and results[name].get("error"):
                    continue
                redone[0] = 0
                try:
                    r = measure(fn, reps=a.reps)
                    r["redone_tokens_per_call"] = redone[0] / (a.reps + 1)
                except torch.OutOfMemoryError:
                    r = dict(ms=None, peak_gib=None, error="OOM")
                except Exception as e:  # a missing baseline must not stop the rest
                    r = dict(ms=None, peak_gib=None, error=f"{type(e).__name__}: {e}"[:300])
                h.grad = w.grad = None
                if hasattr(w, "main_grad"):
                    del w.main_grad
                gc.collect()
                torch.cuda.empty_cache()
                prev = results[name]
                if prev is not None and r.get("ms") is not None:  # pool the repetitions of all rounds
                    r["ms_all"] = prev["ms_all"] + r["ms_all"]
                    r["ms"] = statistics.median(r["ms_all"])
                    r["peak_gib"] = max(prev["peak_gib"], r["peak_gib"])
                    r["above_inputs_gib"] = max(prev["above_inputs_gib"], r["above_inputs_gib"])
                    r["redone_tokens_per_call"] = max(prev["redone_tokens_per_call"], r["redone_tokens_per_call"])
                results[name] = r
        floor = (results.get("3 GEMMs alone (floor)") or {}).get("ms")
        for name, r in results.items():
            r.update(variant=name, tokens=n, vocab=a.vocab, hidden=a.hidden, topk=a.topk)
            if "fused" not in name:
                r.pop("redone_tokens_per_call", None)
            if floor and r.get("ms"):
                r["x_floor"] = r["ms"] / floor
            rows.append(r)
            print(f"N={n:>7} {name:<36} ms={r.get('ms') or float('nan'):9.1f} "
                  f"peak={r.get('peak_gib') or float('nan'):7.2f} GiB  x_floor={r.get('x_floor', float('nan')):.2f} "
                  f"{r.get('error', '')}", flush=True)
        if n <= 32768:
            try:
                result.setdefault("agreement", {})[str(n)] = check_agreement(h, w, ids, logp, impls)
                print("agreement", result["agreement"][str(n)], flush=True)
            except torch.OutOfMemoryError:
                pass
        del h, w, ids, logp, labels
        gc.collect()
        torch.cuda.empty_cache()
        save(a.out, result)


if __name__ == "__main__":
    main()
