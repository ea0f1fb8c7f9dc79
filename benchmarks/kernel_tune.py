"""One-run tuning of impl="fused" on one GPU: every candidate setting against the three-GEMM floor and
Liger-Kernel's fused linear CE, measured in the same run, plus each candidate's accuracy against float64.

  pip install --no-index --no-deps --target /tmp/site .whl/*.whl   # Liger (optional; recorded if absent)
  PYTHONPATH=/tmp/site python3 benchmarks/kernel_tune.py --out benchmarks/results/kernel_tune_h200.json

CPU check of the script's logic (tiny sizes, Triton interpreter, budgets in 64-byte units instead of MiB):
  TRITON_INTERPRET=1 python3 benchmarks/kernel_tune.py --smoke

Timing configs: N=32768 at V=128256/H=3072 and V=201088/H=2880, N=65536 at V=128256 (K=100, bf16,
forward+backward, median of 3 after one warm-up). Accuracy: N=2048 per vocabulary against an fp64 dense
reference (loss <= 1e-3, gradients <= 1e-2 relative norm): soft logits, sharp logits (W x10) with CE,
and bucket tail with CE at T=2 (two-pass path). Every variant and baseline is wrapped: an error is
recorded and the rest runs; a time budget (--budget-s) skips what is left rather than overrun.

Variants are settings of megatron_kd/kernels/fused.py (Z_MIB, E_MIB, OVERLAP, LOGITS), applied by setting
the module attributes for the duration of the variant (the same values the MEGATRON_KD_FUSED_* environment
variables set). To make the winner the default, edit the one line `DEFAULTS = dict(...)` in fused.py;
the table's last column prints that line for each variant. "main_grad" rows use Megatron's gradient-
accumulation fusion (the weight gradient lands in a pre-existing fp32 weight.main_grad): that is a property
of the caller, not a setting, so it never becomes a DEFAULTS line.
"""
import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
from common import environment, gemm_floor, liger, measure, save, synthetic_teacher  # noqa: E402

from megatron_kd import topk_kl_loss  # noqa: E402
from megatron_kd.kernels import fused  # noqa: E402
from megatron_kd.loss.options import LossOptions  # noqa: E402

K = 100
SETTINGS = ("Z_MIB", "E_MIB", "OVERLAP", "LOGITS")

# name -> settings (missing keys: fused.DEFAULTS as committed); main_grad=True: weight.main_grad path.
VARIANTS = {
    "Z256 E512 (previous default)": dict(Z_MIB=256, E_MIB=512),
    "Z256 E1024 (default)": dict(Z_MIB=256, E_MIB=1024),
    "Z256 E2048": dict(Z_MIB=256, E_MIB=2048),
    "Z512 E1024": dict(Z_MIB=512, E_MIB=1024),
    "Z512 E2048": dict(Z_MIB=512, E_MIB=2048),
    "Z256 E1024 overlap": dict(Z_MIB=256, E_MIB=1024, OVERLAP="1"),
    "Z256 E2048 overlap": dict(Z_MIB=256, E_MIB=2048, OVERLAP="1"),
    "Z256 E1024 bf16-logits": dict(Z_MIB=256, E_MIB=1024, LOGITS="bf16"),
    "Z512 E2048 bf16-logits overlap": dict(Z_MIB=512, E_MIB=2048, LOGITS="bf16", OVERLAP="1"),
    "Z256 E1024 main_grad": dict(Z_MIB=256, E_MIB=1024, main_grad=True),
}
SMOKE_EXTRA = {"broken (must be recorded, not stop the run)": dict(LOGITS="nonsense")}


def defaults_line(cfg):
    d = dict(fused.DEFAULTS, LOGITS="fp32")  # Z/E/OVERLAP shape the fp32-logits path; anchored ignores them
    d.update({k: cfg[k] for k in SETTINGS if k in cfg})
    return "DEFAULTS = dict(" + ", ".join(f"{k}={d[k]!r}" for k in SETTINGS) + ")"


@contextlib.contextmanager
def applied(cfg, unit):
    """Set fused's module settings for one variant (unit: bytes per 'MiB', 64 in --smoke)."""
    old = (fused.Z_BYTES, fused.E_BYTES, fused.OVERLAP, fused.LOGITS)
    d = dict(fused.DEFAULTS, LOGITS="fp32")  # Z/E/OVERLAP shape the fp32-logits path; anchored ignores them
    d.update({k: cfg[k] for k in SETTINGS if k in cfg})
    try:
        fused.Z_BYTES, fused.E_BYTES = int(d["Z_MIB"]) * unit, int(d["E_MIB"]) * unit
        fused.OVERLAP, fused.LOGITS = str(d["OVERLAP"]) == "1", str(d["LOGITS"])
        yield
    finally:
        fused.Z_BYTES, fused.E_BYTES, fused.OVERLAP, fused.LOGITS = old


def inputs(n, vocab, hidden, dev, wscale=0.02, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    h = (torch.randn(n, hidden, device=dev, generator=g) * 0.5).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device=dev, generator=g) * wscale).to(torch.bfloat16).requires_grad_(True)
    ids, logp = synthetic_teacher(n, min(K, vocab // 4), vocab, dev, seed)
    return h, w, ids, logp, ids[:, 0].long()


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def cpu_measure(fn, reps=3, warmup=1):
    """--smoke stand-in for common.measure (which needs CUDA): wall time only."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return dict(ms=sorted(times)[len(times) // 2], ms_all=times, peak_gib=None, above_inputs_gib=None)


# ------------------------------------------------------------------ runs
def fused_run(h, w, ids, logp, main_grad, **kw):
    def run():
        h.grad = w.grad = None
        if main_grad:
            if getattr(w, "main_grad", None) is None:
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            w.main_grad.zero_()
        topk_kl_loss(h, w, ids, logp, impl="fused", **kw).backward()
    return run


def reference(h, w, ids, logp, labels, tail, ce, T):
    """Independent float64 dense reference (plain log_softmax + autograd), mean reduction."""
    h64 = h.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    z = h64 @ w64.t()
    ids = ids.long()
    lp = logp.double()
    p = lp.exp()
    lq = torch.log_softmax(z / T, -1)
    lqk = lq.gather(1, ids)
    kl = (p * (lp - lqk)).sum(1)
    if tail == "bucket":
        R = (1 - p.sum(1)).clamp_min(0)
        r = (1 - lqk.exp().sum(1)).clamp_min(1e-300)
        kl = kl + torch.where(R > 0, R * (R.clamp_min(1e-300).log() - r.log()), torch.zeros_like(R))
    loss = T * T * kl
    if ce:
        loss = loss + ce * (-torch.log_softmax(z, -1).gather(1, labels[:, None])[:, 0])
    loss = loss.mean()
    loss.backward()
    out = (loss.detach().item(), h64.grad, w64.grad)
    del z, lq, h64, w64
    return out


def relnorm(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


ACC_CASES = [  # name, tail, ce, T, weight scale
    ("soft none", "none", 0.0, 1.0, 0.02),
    ("sharp W x10 none ce=0.5", "none", 0.5, 1.0, 0.2),
    ("bucket ce=0.5 T=2 (two-pass)", "bucket", 0.5, 2.0, 0.02),
]


def accuracy(variants, shapes, n, dev, unit, out, deadline):
    for vocab, hidden in shapes:
        for cname, tail, ce, T, ws in ACC_CASES:
            key = f"V={vocab} {cname}"
            try:
                h, w, ids, logp, labels = inputs(n, vocab, hidden, dev, ws, seed=1)
                ref = reference(h, w, ids, logp, labels, tail, ce, T)
            except Exception as ex:
                for v in variants:
                    out[v].setdefault("accuracy", {})[key] = dict(error=f"reference: {type(ex).__name__}: {ex}"[:300])
                continue
            for vname, cfg in variants.items():
                acc = out[vname].setdefault("accuracy", {})
                if time.time() > deadline:
                    acc[key] = dict(error="skipped: time budget")
                    continue
                try:
                    with applied(cfg, unit):
                        h.grad = w.grad = None
                        mg = cfg.get("main_grad")
                        if mg:
                            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=dev)
                        loss = topk_kl_loss(h, w, ids, logp, labels=labels, tail=tail, ce_weight=ce, temperature=T,
                                            impl="fused")
                        loss.backward()
                        gw = w.main_grad if mg else w.grad
                        r = dict(loss_rel=abs(loss.item() - ref[0]) / abs(ref[0]), grad_h_rel=relnorm(h.grad, ref[1]),
                                 grad_w_rel=relnorm(gw, ref[2]))
                        if mg:
                            del w.main_grad
                    r["pass"] = r["loss_rel"] <= 1e-3 and r["grad_h_rel"] <= 1e-2 and r["grad_w_rel"] <= 1e-2
                    acc[key] = r
                except Exception as ex:
                    acc[key] = dict(error=f"{type(ex).__name__}: {ex}"[:300], trace=traceback.format_exc()[-800:])
                    if hasattr(w, "main_grad"):
                        del w.main_grad
            del h, w, ids, logp, labels, ref
            cleanup(dev)


def cleanup(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def timing(variants, configs, dev, unit, meas, out, baselines, deadline, reps):
    for n, vocab, hidden in configs:
        ckey = f"N={n} V={vocab} H={hidden}"
        base = out["baselines"].setdefault(ckey, {})
        try:
            h, w, ids, logp, labels = inputs(n, vocab, hidden, dev)
        except Exception as ex:
            base["error"] = f"inputs: {type(ex).__name__}: {ex}"[:300]
            continue
        runs = [("gemm_floor", gemm_floor(h, w))] if "gemm" in baselines else []
        if "liger" in baselines:
            runs.append(("liger_fused_linear_ce", None))
        for bname, fn in runs:
            if time.time() > deadline:
                base[bname] = dict(error="skipped: time budget")
                continue
            try:
                base[bname] = meas(fn or liger(h, w, labels), reps=reps)
            except Exception as ex:
                base[bname] = dict(error=f"{type(ex).__name__}: {ex}"[:300])
            h.grad = w.grad = None
            cleanup(dev)
        floor = base.get("gemm_floor", {}).get("ms")
        liger_res = base.get("liger_fused_linear_ce", {})
        for vname, cfg in variants.items():
            tim = out[vname].setdefault("timing", {})
            if time.time() > deadline:
                tim[ckey] = dict(error="skipped: time budget")
                continue
            try:
                with applied(cfg, unit):
                    r = meas(fused_run(h, w, ids, logp, bool(cfg.get("main_grad"))), reps=reps)
                    r["chunks"] = list(fused.plan_chunks(n, vocab, LossOptions(), scaled=True))
                if floor:
                    r["x_floor"] = r["ms"] / floor
                if liger_res.get("ms"):
                    r["x_liger"] = r["ms"] / liger_res["ms"]
                if liger_res.get("peak_gib") and r.get("peak_gib"):
                    r["peak_vs_liger"] = r["peak_gib"] / liger_res["peak_gib"]
                tim[ckey] = r
            except Exception as ex:
                tim[ckey] = dict(error=f"{type(ex).__name__}: {ex}"[:300], trace=traceback.format_exc()[-800:])
            finally:
                h.grad = w.grad = None
                if hasattr(w, "main_grad"):
                    del w.main_grad
                cleanup(dev)
        del h, w, ids, logp, labels
        cleanup(dev)


def rank(variants, out, configs):
    """Score: geometric mean of x_floor (or of ms when no floor) over the timing configs; variants failing
    any accuracy case rank after those passing all; missing timings rank last."""
    rows = []
    for vname in variants:
        r = out[vname]
        acc = r.get("accuracy", {})
        acc_ok = bool(acc) and all(a.get("pass") for a in acc.values())
        worst = max([max(a.get("loss_rel", 0), a.get("grad_h_rel", 0), a.get("grad_w_rel", 0))
                     for a in acc.values() if "error" not in a] or [float("nan")])
        tim = r.get("timing", {})
        xs = [tim.get(f"N={n} V={v} H={hh}", {}) for n, v, hh in configs]
        vals = [t.get("x_floor", t.get("ms")) for t in xs]
        score = math.exp(sum(math.log(x) for x in vals) / len(vals)) if vals and all(vals) else float("inf")
        r["score"] = score
        r["accuracy_pass"] = acc_ok
        rows.append((not acc_ok, score, vname, xs, worst))
    rows.sort(key=lambda x: (x[0], x[1]))
    return rows


def fmt(x, f="{:.3f}"):
    return "-" if x is None else f.format(x)


def table(rows, configs, variants, out):
    heads = [f"N={n} V={v}" for n, v, _ in configs]
    lines = ["| rank | variant | " + " | ".join(f"{h} x floor (ms, peak GiB)" for h in heads)
             + " | score | accuracy (worst rel) | DEFAULTS line |", "|" + "---|" * (len(heads) + 6)]
    for i, (bad, score, vname, xs, worst) in enumerate(rows, 1):
        cells = []
        for t in xs:
            if "error" in t or not t:
                cells.append((t.get("error") or "missing")[:40])
            else:
                cells.append(f"{fmt(t.get('x_floor'))} ({fmt(t.get('ms'), '{:.1f}')}, {fmt(t.get('peak_gib'), '{:.2f}')})")
        cfg = variants[vname]
        line = "n/a (caller property)" if cfg.get("main_grad") else defaults_line(cfg)
        lines.append(f"| {i} | {vname} | " + " | ".join(cells) + f" | {fmt(score)} | "
                     + ("pass" if not bad else "FAIL") + f" ({worst:.1e}) | `{line}` |")
    base = out["baselines"]
    lines.append("")
    for ckey, b in base.items():
        fl, lg = b.get("gemm_floor", {}), b.get("liger_fused_linear_ce", {})
        lines.append(f"{ckey}: floor {fmt(fl.get('ms'), '{:.1f}')} ms ({fmt(fl.get('peak_gib'), '{:.2f}')} GiB)"
                     f"{' ' + fl['error'] if 'error' in fl else ''}; Liger {fmt(lg.get('ms'), '{:.1f}')} ms "
                     f"({fmt(lg.get('peak_gib'), '{:.2f}')} GiB, x floor "
                     f"{fmt(lg['ms'] / fl['ms'] if lg.get('ms') and fl.get('ms') else None)})"
                     f"{' ' + lg['error'][:80] if 'error' in lg else ''}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny sizes")
    ap.add_argument("--only", nargs="*", default=None, help="substrings of variant names to run")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip what is left past this many seconds (default 215; --smoke 900)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 3; --smoke 1)")
    a = ap.parse_args()
    a.budget_s = a.budget_s or (900.0 if a.smoke else 215.0)
    a.reps = a.reps or (1 if a.smoke else 3)
    t0 = time.time()
    deadline = t0 + a.budget_s
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    variants = dict(VARIANTS, **(SMOKE_EXTRA if a.smoke else {}))
    if a.only:
        variants = {k: v for k, v in variants.items() if any(s in k for s in a.only)}
    if a.smoke:
        unit, meas = 64, cpu_measure
        configs = [(64, 500, 32), (64, 700, 24), (128, 500, 32)]
        acc_shapes, acc_n = [(500, 32), (700, 24)], 32
    else:
        unit, meas = fused.MIB, measure
        configs = [(32768, 128256, 3072), (32768, 201088, 2880), (65536, 128256, 3072)]
        acc_shapes, acc_n = [(128256, 3072), (201088, 2880)], 2048
    env = environment()
    env["device"] = str(dev)
    env["fused_defaults"] = dict(fused.DEFAULTS)
    print(json.dumps(env), flush=True)
    out = {v: dict(settings=cfg) for v, cfg in variants.items()}
    out["baselines"] = {}
    try:
        accuracy(variants, acc_shapes, acc_n, dev, unit, out, deadline - 0.45 * a.budget_s)
    except Exception as ex:  # never lose the timings to an accuracy-phase bug
        out["accuracy_error"] = f"{type(ex).__name__}: {ex}"
    print(f"accuracy done at {time.time() - t0:.0f} s", flush=True)
    try:
        timing(variants, configs, dev, unit, meas, out, ("gemm", "liger"), deadline, a.reps)
    except Exception as ex:
        out["timing_error"] = f"{type(ex).__name__}: {ex}"
    rows = rank(variants, out, configs)
    tab = table(rows, configs, variants, out)
    try:
        from megatron_kd.kernels.ops import rows as krows
        env["sweep_best_config"] = str(getattr(krows._sweep_tuned, "best_config", None))
    except Exception:
        pass
    env["wall_s"] = round(time.time() - t0, 1)
    print(tab, flush=True)
    best = [r for r in rows if not r[0] and not variants[r[2]].get("main_grad")]
    payload = dict(env=env, configs=configs, accuracy_n=acc_n, variants=out, ranking=[r[2] for r in rows],
                   table=tab, winner=best[0][2] if best else None,
                   winner_defaults_line=defaults_line(variants[best[0][2]]) if best else None)
    print(json.dumps(dict(winner=payload["winner"], line=payload["winner_defaults_line"],
                          wall_s=env["wall_s"]), default=str), flush=True)
    if a.out:
        save(a.out, json.loads(json.dumps(payload, default=str)))


if __name__ == "__main__":
    main()
