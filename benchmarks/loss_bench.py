"""Loss-only benchmark: output projection + sparse top-K KL, forward + backward, every row against the three bf16
GEMMs alone (the floor) measured in the same run.

  python benchmarks/loss_bench.py --out R.json                     # impls, Liger / CCE (CE only), fused settings
  python benchmarks/loss_bench.py --settings logits=fp32 a_mib=768 --out R.json   # extra fused variants
  python benchmarks/loss_bench.py --profile --out R.json           # + torch.profiler: kernel table, syncs, GPU gaps
  torchrun --nproc_per_node 2 benchmarks/loss_bench.py --tp --vocab 201088 --hidden 2880 --out R.json
  python benchmarks/loss_bench.py --compare .old-ad4c281 --out R.json   # an earlier copy of the package vs this one
  TRITON_INTERPRET=1 python benchmarks/loss_bench.py --smoke [--compare DIR] --out /tmp/x.json   # CPU, tiny sizes

--compare DIR: DIR holds an earlier megatron_kd (e.g. `git archive ad4c281 megatron_kd | tar -x -C DIR`). Two worker
processes, one per code (PYTHONPATH=DIR, PYTHONPATH=this tree), build the same inputs from the same seeds and run the
fused loss with the production defaults (bf16, weight gradient into a pre-allocated fp32 main_grad as under
Megatron's DDP; and plain .grad); the floor runs in the new code's worker. Rounds alternate the order of the two
codes, so clock drift hits both alike. Each row records ms (median over all rounds), x_floor, peak memory (inputs
included) and the loss and gradient sums, so equal numbers are visible too; `compare` lists new / old per shape.
"""
import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`

import torch  # noqa: E402

sys.path.insert(0, HERE)
from common import cce, environment, gemm_floor, liger, measure, save, synthetic_teacher  # noqa: E402

# --compare shapes (vocab, hidden, tokens): Llama 3 at 32K and 65K tokens, GPT-OSS at 32K
COMPARE_SHAPES = [(128256, 3072, 32768), (128256, 3072, 65536), (201088, 2880, 32768)]
SMOKE_SHAPES = [(300, 32, 48)]


def inputs(n, vocab, hidden, topk, dev, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    h = (torch.randn(n, hidden, device=dev) * 0.5).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device=dev) * 0.02).to(dtype).requires_grad_(True)
    ids, logp = synthetic_teacher(n, topk, vocab, dev)
    return h, w, ids, logp


def ours(h, w, ids, logp, impl, labels=None, ce_weight=0.0, main_grad=False, **kw):
    """One forward + backward of topk_kl_loss. main_grad: Megatron's gradient-accumulation fusion, the fp32
    weight.main_grad exists before the loss runs (DDP allocates it), so it counts as an input."""
    from megatron_kd import topk_kl_loss

    def run():
        if main_grad and getattr(w, "main_grad", None) is None:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        h.grad = w.grad = None
        if main_grad:
            w.main_grad.zero_()
        loss = topk_kl_loss(h, w, ids, logp, labels=labels, ce_weight=ce_weight, impl=impl, **kw)
        loss.backward()
        run.loss = loss.detach()
    return run


def sums(run, h, w):
    """Loss and gradient sums of the last call (float64): identical code gives identical numbers."""
    gw = getattr(w, "main_grad", None) if getattr(w, "main_grad", None) is not None else w.grad
    return dict(loss=float(run.loss.double()), grad_h_abs_sum=float(h.grad.double().abs().sum()),
                grad_w_abs_sum=None if gw is None else float(gw.double().abs().sum()))


def parse_settings(spec: str) -> dict:
    """'logits=fp32,a_mib=768' -> dict(logits='fp32', a_mib=768) (FusedSettings fields)."""
    out = {}
    for kv in filter(None, spec.split(",")):
        k, v = kv.split("=", 1)
        out[k] = v if not v.lstrip("-").isdigit() else int(v)
    return out


def drop(h, w):
    h.grad = w.grad = None
    if hasattr(w, "main_grad"):
        del w.main_grad
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(fn, reps, h, w):
    try:
        r = measure(fn, reps=reps)
    except torch.OutOfMemoryError:
        r = dict(ms=None, peak_gib=None, error="OOM")
    except Exception as e:  # a missing baseline must not stop the rest
        r = dict(ms=None, peak_gib=None, error=f"{type(e).__name__}: {e}"[:300])
    if r.get("ms") is not None and hasattr(fn, "loss"):
        r.update(sums(fn, h, w))
    drop(h, w)
    return r


def pool(prev, r):
    """Repetitions of all rounds pooled: ms = median of all, peak = max."""
    if prev is None or r.get("ms") is None or prev.get("ms") is None:
        return r if prev is None or r.get("error") else prev
    r["ms_all"] = prev["ms_all"] + r["ms_all"]
    r["ms"] = statistics.median(r["ms_all"])
    for k in ("peak_gib", "above_inputs_gib"):
        if r.get(k) is not None:
            r[k] = max(prev[k], r[k])
    return r


# ---------------------------------------------------------------- default mode
def variants_for(a, h, w, ids, logp):
    from megatron_kd.kernels import fused_available
    v = {}
    if "gemm" in a.baselines:
        v["3 GEMMs alone (floor)"] = gemm_floor(h, w)
    for impl in a.impls:
        if impl == "fused" and not fused_available() and not SMOKE:
            continue
        v[f"ours {impl}"] = ours(h, w, ids, logp, impl)
        if impl == "fused":
            v["ours fused, grad into main_grad"] = ours(h, w, ids, logp, "fused", main_grad=True)
            for div in a.divergences:  # the same fused path with another divergence
                v[f"ours fused {div}"] = ours(h, w, ids, logp, "fused", divergence=div)
                v[f"ours fused {div}, grad into main_grad"] = ours(h, w, ids, logp, "fused", main_grad=True,
                                                                  divergence=div)
            for spec in a.settings:
                from megatron_kd.loss import FusedSettings
                fs = FusedSettings(**parse_settings(spec))
                v[f"ours fused {spec}, grad into main_grad"] = ours(h, w, ids, logp, "fused", main_grad=True,
                                                                  fused_settings=fs)
    labels = ids[:, 0].long()
    if "liger" in a.baselines:
        v["Liger fused linear CE (CE only)"] = liger(h, w, labels)
    if "cce" in a.baselines:
        v["Cut Cross-Entropy (CE only)"] = cce(h, w, labels)
    return v


def bench(a, dev):
    rows = []
    result = dict(env=environment(), args=vars(a), rows=rows)
    for n in a.tokens:
        h, w, ids, logp = inputs(n, a.vocab, a.hidden, a.topk, dev)
        variants = variants_for(a, h, w, ids, logp)
        results = {name: None for name in variants}
        for _ in range(a.rounds):  # every variant once per round, so clock drift hits all alike
            for name, fn in variants.items():
                if results[name] is None or not results[name].get("error"):
                    results[name] = pool(results[name], timed(fn, a.reps, h, w))
        floor = (results.get("3 GEMMs alone (floor)") or {}).get("ms")
        if a.divergences:
            result.setdefault("divergences", {})[str(n)] = divergence_check(results, floor, a.divergences)
        for name, r in results.items():
            r.update(variant=name, tokens=n, vocab=a.vocab, hidden=a.hidden, topk=a.topk)
            if floor and r.get("ms"):
                r["x_floor"] = r["ms"] / floor
            rows.append(r)
            print(f"N={n:>7} {name:<48} ms={r.get('ms') or float('nan'):9.1f} "
                  f"peak={r.get('peak_gib') or float('nan'):7.2f} GiB x_floor={r.get('x_floor', float('nan')):.3f} "
                  f"{r.get('error', '')}", flush=True)
        if a.profile and "fused" in a.impls:
            result.setdefault("profile", {})[str(n)] = {
                name: profile_one(fn) for name, fn in variants.items() if name.startswith("ours fused")}
            drop(h, w)
        del h, w, ids, logp, variants
        drop_all()
        save(a.out, result)
    return result


def divergence_check(results, floor, divergences):
    """The bar per divergence: x the floor (<= 1.20) and peak memory against fused forward KL (<= +0.1 GiB),
    for plain .grad and grad into main_grad."""
    out = {}
    for div in divergences:
        for suffix in ("", ", grad into main_grad"):
            r, f = results.get(f"ours fused {div}{suffix}") or {}, results.get(f"ours fused{suffix}") or {}
            if r.get("ms") and f.get("peak_gib") is not None and floor:
                x, dm = r["ms"] / floor, r["peak_gib"] - f["peak_gib"]
                out[f"{div}{suffix}"] = dict(x_floor=x, peak_minus_forward_kl_gib=dm, forward_kl_x_floor=f["ms"] / floor,
                                             bar_met=x <= 1.20 and dm <= 0.1)
    print(json.dumps(out, indent=1), flush=True)
    return out


def drop_all():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- --profile
def profile_one(fn):
    """CUDA time by kernel, host-side syncs and the GPU timeline's idle gaps of one warm call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t0) * 1e3  # until the host has queued everything
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
        sync()
    ev = prof.key_averages()
    dev_ms = sorted(((x.key, x.count, x.device_time_total / 1e3) for x in ev if x.device_time_total > 0),
                    key=lambda r: -r[2])
    syncs = {x.key: x.count for x in ev if any(s in x.key for s in ("Synchronize", "Memcpy", "item", "nonzero",
                                                                    "local_scalar"))}
    ks = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, idle, gaps, end = 0.0, 0.0, 0, ks[0][0] if ks else 0.0
    for s0, s1 in ks:
        if s0 > end:
            idle, gaps = idle + s0 - end, gaps + 1
        busy += max(0.0, s1 - max(s0, end))
        end = max(end, s1)
    rec = dict(host_ms=host_ms, kernel_ms=sum(r[2] for r in dev_ms), launches=sum(r[1] for r in dev_ms),
               busy_ms=busy / 1e3, idle_ms=idle / 1e3, gaps=gaps, host_syncs=syncs,
               top=[dict(name=k[:100], count=c, ms=ms) for k, c, ms in dev_ms[:20]])
    print(f"   profile: {rec['kernel_ms']:.1f} ms kernels in {rec['launches']} launches, idle {rec['idle_ms']:.1f} ms "
          f"in {gaps} gaps, host {host_ms:.1f} ms, syncs {syncs}", flush=True)
    for r in rec["top"][:12]:
        print(f"     {r['ms']:8.2f} ms x{r['count']:<5} {r['name']}")
    return rec


# ---------------------------------------------------------------- --tp (torchrun)
@contextlib.contextmanager
def no_collectives():
    """Every all_reduce becomes a no-op (looked up at call time by megatron_kd.parallel.comm): same arithmetic,
    wrong numbers, so the difference to the real row is what communication costs."""
    import torch.distributed as dist
    saved = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: None
    try:
        yield
    finally:
        dist.all_reduce = saved


def bench_tp(a, dev):
    import torch.distributed as dist
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    rows = []
    for n in a.tokens:
        h_full, w_full, ids, logp = inputs(n, a.vocab, a.hidden, a.topk, dev)
        vl = a.vocab // world
        g = dist.group.WORLD

        def case(name, h, w, only0=False, **kw):
            h = h.detach().clone().requires_grad_(True)
            w = w.detach().clone().requires_grad_(True)
            dist.barrier()
            r = timed(ours(h, w, ids, logp, **kw), a.reps, h, w) if (rank == 0 or not only0) else None
            gathered = [None] * world
            dist.all_gather_object(gathered, r)
            for x in gathered:
                if x is not None:
                    x.update(variant=name, tokens=n, vocab=a.vocab, hidden=a.hidden, topk=a.topk)
            if rank == 0:
                rows.extend(x for i, x in enumerate(gathered) if x is not None and (x.setdefault("rank", i) or True))
                print(name, [(x.get("rank"), x.get("ms"), x.get("peak_gib")) for x in gathered if x], flush=True)

        for impl in a.impls:
            case(f"{impl} TP=1", h_full, w_full, only0=True, impl=impl)
            shard = w_full[rank * vl:(rank + 1) * vl]
            case(f"{impl} TP={world}", h_full, shard, impl=impl, tp_group=g)
            with no_collectives():
                case(f"{impl} TP={world} collectives removed", h_full, shard, impl=impl, tp_group=g)
            hs = h_full[rank * (n // world):(rank + 1) * (n // world)]
            case(f"{impl} TP={world} sequence parallel", hs, shard, impl=impl, tp_group=g, sequence_parallel=True)
    if rank == 0:
        save(a.out, dict(env=environment(), args=vars(a), world=world, rows=rows))
    dist.destroy_process_group()


# ---------------------------------------------------------------- --compare (workers)
def worker(dev, smoke):
    """Reads one JSON job per line from stdin, answers one JSON line on stdout. Inputs are cached per shape."""
    import megatron_kd
    out = sys.stdout
    sys.stdout = sys.stderr  # prints of the package or this script must not break the protocol
    out.write(json.dumps(dict(ready=True, package=os.path.dirname(megatron_kd.__file__))) + "\n")
    out.flush()
    cache = {}
    for line in sys.stdin:
        job = json.loads(line)
        key = (job["tokens"], job["vocab"], job["hidden"], job["topk"], job["dtype"])
        if key not in cache:
            cache.clear()
            drop_all()
            cache[key] = inputs(job["tokens"], job["vocab"], job["hidden"], job["topk"], dev,
                                getattr(torch, job["dtype"]))
        h, w, ids, logp = cache[key]
        if job["variant"] == "floor":
            fn = gemm_floor(h, w)
        else:
            fn = ours(h, w, ids, logp, "fused", main_grad=job["variant"] == "fused, grad into main_grad")
        r = timed(fn, job["reps"], h, w)
        out.write(json.dumps(r) + "\n")
        out.flush()


class Worker:
    def __init__(self, name, pythonpath, smoke):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([pythonpath, HERE]))
        if smoke:
            env["TRITON_INTERPRET"] = "1"
        cmd = [sys.executable, os.path.abspath(__file__), "--worker"] + (["--smoke"] if smoke else [])
        self.name = name
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, cwd=HERE)
        hello = json.loads(self.p.stdout.readline() or "{}")
        if not hello.get("ready"):
            raise RuntimeError(f"worker {name} did not start (PYTHONPATH={pythonpath})")
        self.package = hello["package"]
        want = os.path.realpath(os.path.join(pythonpath, "megatron_kd"))
        if os.path.realpath(self.package) != want:
            raise RuntimeError(f"worker {name} imported megatron_kd from {self.package}, not {want}")

    def __call__(self, **job):
        self.p.stdin.write(json.dumps(job) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} died on {job}")
        return json.loads(line)

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


def rel_diff(new, old):
    return None if new is None or old is None else abs(new - old) / max(abs(old), 1e-30)


def compare(a):
    old_dir = os.path.abspath(a.compare)
    if not os.path.isdir(os.path.join(old_dir, "megatron_kd")):
        raise SystemExit(f"--compare {a.compare}: no megatron_kd/ there; make it with "
                         f"`mkdir -p {a.compare} && git archive ad4c281 megatron_kd | tar -x -C {a.compare}`")
    t_start = time.time()
    workers = {"old": Worker("old", old_dir, SMOKE), "new": Worker("new", ROOT, SMOKE)}
    shapes = SMOKE_SHAPES if SMOKE else [tuple(s) for s in a.shapes]
    names = ["fused, grad into main_grad", "fused"]
    rows, summary = [], []
    result = dict(env=environment(), args=vars(a), packages={k: w.package for k, w in workers.items()},
                  rows=rows, compare=summary)
    for dtype in a.dtypes:
        for vocab, hidden, n in shapes:
            job = dict(tokens=n, vocab=vocab, hidden=hidden, topk=a.topk if not SMOKE else 5, dtype=dtype, reps=a.reps)
            res = {}
            for rnd in range(a.rounds):
                order = ["old", "new"] if rnd % 2 == 0 else ["new", "old"]
                res["floor"] = pool(res.get("floor"), workers["new"](variant="floor", **job))
                for name in names:
                    for code in order:
                        res[(code, name)] = pool(res.get((code, name)), workers[code](variant=name, **job))
            floor = res["floor"].get("ms")
            for key, r in res.items():
                code, name = ("new", "3 GEMMs alone (floor)") if key == "floor" else key
                r.update(code=code, variant=name, tokens=n, vocab=vocab, hidden=hidden, topk=job["topk"], dtype=dtype)
                if floor and r.get("ms"):
                    r["x_floor"] = r["ms"] / floor
                rows.append(r)
                print(f"{dtype} V={vocab} H={hidden} N={n:>6} {code:>3} {name:<28} "
                      f"ms={r.get('ms') or float('nan'):8.1f}"
                      f" x_floor={r.get('x_floor', float('nan')):.4f} peak={r.get('peak_gib') or float('nan'):.3f} GiB "
                      f"{r.get('error', '')}", flush=True)
            for name in names:
                o, w_ = res[("old", name)], res[("new", name)]
                if o.get("ms") is None or w_.get("ms") is None:
                    summary.append(dict(variant=name, vocab=vocab, hidden=hidden, tokens=n, dtype=dtype,
                                        error=o.get("error") or w_.get("error")))
                    continue
                s = dict(variant=name, vocab=vocab, hidden=hidden, tokens=n, dtype=dtype,
                         x_floor_old=o.get("x_floor"), x_floor_new=w_.get("x_floor"),
                         ratio_new_over_old=w_["ms"] / o["ms"],
                         peak_gib_old=o["peak_gib"], peak_gib_new=w_["peak_gib"],
                         peak_diff_gib=None if o["peak_gib"] is None else w_["peak_gib"] - o["peak_gib"],
                         same_loss=o.get("loss") == w_.get("loss"),
                         loss_rel_diff=rel_diff(w_["loss"], o["loss"]),
                         grad_h_rel_diff=rel_diff(w_["grad_h_abs_sum"], o["grad_h_abs_sum"]),
                         grad_w_rel_diff=rel_diff(w_["grad_w_abs_sum"], o["grad_w_abs_sum"]))
                s["within_2pct"] = abs(s["ratio_new_over_old"] - 1) <= 0.02
                s["within_0.05gib"] = s["peak_diff_gib"] is None or abs(s["peak_diff_gib"]) <= 0.05
                summary.append(s)
                print(f"  => {name}: new/old {s['ratio_new_over_old']:.4f}, peak diff {s['peak_diff_gib']} GiB, "
                      f"loss rel diff {s['loss_rel_diff']:.2e}", flush=True)
            save(a.out, result)
    for w in workers.values():
        w.close()
    result["ok"] = all(s.get("within_2pct") and s.get("within_0.05gib") for s in summary)
    result["wall_s"] = time.time() - t_start
    save(a.out, result)
    print(f"compare: {'OK' if result['ok'] else 'NOT within bounds'} in {result['wall_s']:.0f} s")
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 65536, 262144])
    ap.add_argument("--impls", nargs="+", default=["dense", "chunked", "forward_chunked", "fused"])
    ap.add_argument("--baselines", nargs="+", default=["gemm", "liger", "cce"])
    ap.add_argument("--settings", nargs="*", default=[],
                    help="extra fused variants (main_grad), FusedSettings fields: logits=fp32 a_mib=768 z_mib=256,e_mib=1024")
    ap.add_argument("--divergences", nargs="*", default=[], choices=["reverse_kl", "jsd"],
                    help="also time fused with these divergences (x floor, peak vs fused forward KL)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="passes over all variants; ms = median of all reps")
    ap.add_argument("--profile", action="store_true", help="also profile each fused variant once (torch.profiler)")
    ap.add_argument("--tp", action="store_true", help="under torchrun: TP=1 vs TP=world, SP, collectives removed")
    ap.add_argument("--compare", metavar="DIR",
                    help="an earlier copy of the package (DIR/megatron_kd) against this one")
    ap.add_argument("--shapes", type=lambda s: [int(x) for x in s.split(",")], nargs="+", default=COMPARE_SHAPES,
                    help="--compare: vocab,hidden,tokens triples")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], help="--compare: input dtypes (float16: two-pass)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, Triton interpreter: the script's logic")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device("cpu" if a.smoke else "cuda")
    if a.worker:
        return worker(dev, a.smoke)
    if not a.out:
        ap.error("--out is required")
    if a.compare:
        if a.smoke:
            a.reps = 1
        return compare(a)
    if a.smoke:
        a.vocab, a.hidden, a.topk, a.tokens, a.reps, a.rounds = 300, 32, 5, [64], 1, 1
        a.baselines = [b for b in a.baselines if b == "gemm"]
    if a.tp:
        return bench_tp(a, dev)
    bench(a, dev)


if __name__ == "__main__":
    sys.path.insert(0, ROOT) if not os.environ.get("PYTHONPATH") else None
    main()
