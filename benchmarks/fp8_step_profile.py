"""Where one training step's GPU time goes: `megatron-kd train` of a recipe (default the FP8 32K 3.2B student,
llama31_8b_to_3b_32k_1xh200_fp8, mock data, a cache from the random 8B teacher) with one iteration under
torch.profiler, its kernels split by a stated rule.

The run is the real CLI (megatron_kd.cli.main.main) in this process, with three annotations added by wrapping, no
other change: the KD head (the fused loss and its output-layer GEMMs) in `mkd::kd_loss`, the optimizer's step in
`mkd::optimizer`, and the profiled window `mkd::step` from the start of iteration --profile-iter's forward-backward
to the start of the next one's (so it holds one forward-backward, one optimizer step and the loop's own work; the GPU
is synchronized at both ends). The unprofiled iterations give the step time and TFLOP/s of the same process.

The rule (first match wins), for each GPU kernel / memcpy / memset in the window, by the CPU call stack at its
launch (the nesting of the trace's CPU ops on the launching thread) and then by its name:
  optimizer   launched inside `mkd::optimizer`
  kd_loss     inside `mkd::kd_loss`, or inside the loss's autograd backward (a frame naming TopKKL)
  recompute   inside an activation checkpoint's backward (a frame naming CheckpointFunctionBackward: megatron's
              or TE's) and not inside a nested autograd function below it: the forward that recomputation re-runs
  attention   kernel name matches flash|fmha|sdpa|attn|attention (cuDNN / flash fused attention)
  gemm        kernel name matches gemm|nvjet|cutlass|xmma|cublas|wgmma|matmul|gemv (cuBLAS(Lt), CUTLASS)
  other       the rest, sub-split by name: fp8_cast (cast|quantiz|amax|transpose|fp8), norm, rope,
              elementwise (swiglu|silu|act|elementwise|vectorized|unrolled|pointwise|reduce), memcpy/memset, rest
Each of gemm and attention is also split into forward and backward (a frame `autograd::engine::evaluate_function`
above the launch: backward); recompute, kd_loss and optimizer are sub-split by the same name classes.
idle = the window's wall time minus the union of all GPU intervals in it (time the GPU ran nothing).

  source .whlte/device_install.sh && python3 benchmarks/fp8_step_profile.py --out $OUT/fp8_step_profile_h200.json
CPU smoke (tiny_cpu; no GPU, so the CPU ops with no child op stand in for kernels): python fp8_step_profile.py --smoke
"""
import argparse
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

RECIPE = "llama31_8b_to_3b_32k_1xh200_fp8"
QUIET = ["train.eval_iters=0", "train.eval_interval=null", "train.save_interval=null", "train.save_at_end=false",
         "train.log_interval=1", "train.progress=false", "train.tensorboard=false"]

ATTENTION = re.compile(r"flash|fmha|sdpa|attn|attention", re.I)
GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|wgmma|matmul|gemv|aten::mm|aten::addmm|aten::bmm", re.I)
NAME_CLASSES = [("attention", ATTENTION), ("gemm", GEMM),
                ("fp8_cast", re.compile(r"cast|quantiz|amax|transpose|fp8", re.I)),
                ("norm", re.compile(r"norm", re.I)), ("rope", re.compile(r"rope|rotary", re.I)),
                ("elementwise", re.compile(r"swiglu|silu|act|elementwise|vectorized|unrolled|pointwise|reduce", re.I)),
                ("memcpy_memset", re.compile(r"memcpy|memset|copy|fill", re.I))]
BACKWARD = "autograd::engine::evaluate_function"


def name_class(name: str) -> str:
    for cls, rx in NAME_CLASSES:
        if rx.search(name):
            return cls
    return "rest"


def classify(name: str, stack: list) -> tuple:
    """(category, subclass) of one device event by the module docstring's rule; stack: outermost first."""
    if any(f == "mkd::optimizer" for f in stack):
        return "optimizer", name_class(name)
    if any(f == "mkd::kd_loss" or "TopKKL" in f for f in stack):
        return "kd_loss", name_class(name)
    ck = [i for i, f in enumerate(stack) if "CheckpointFunctionBackward" in f]
    if ck and not any(f.startswith(BACKWARD) for f in stack[ck[-1] + 1:]):
        return "recompute", name_class(name)
    bwd = any(f.startswith(BACKWARD) for f in stack)
    if ATTENTION.search(name):
        return "attention", "backward" if bwd else "forward"
    if GEMM.search(name):
        return "gemm", "backward" if bwd else "forward"
    return "other", name_class(name)


def stacks_at(ops: list, points: list) -> dict:
    """ops: [(ts, end, name)] of one thread; points: [(ts, key)]. {key: [names of the ops enclosing ts]}."""
    ev = sorted([(ts, 0, -(end - ts), end, name) for ts, end, name in ops] +
                [(ts, 1, 0, ts, key) for ts, key in points], key=lambda e: (e[0], e[1], e[2]))
    stack, out = [], {}
    for ts, kind, _, end, what in ev:
        while stack and stack[-1][0] < ts:
            stack.pop()
        if kind == 0:
            stack.append((end, what))
        else:
            out[what] = [n for _, n in stack]
    return out


def analyze(trace_path: str, leaf_ops: bool = False) -> dict:
    """The split of the `mkd::step` window of a chrome trace. leaf_ops: CPU ops with no child op stand in for
    kernels (a CPU-only trace: the smoke test of the rule)."""
    op = gzip.open if trace_path.endswith(".gz") else open
    with op(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    window = [e for e in events if e.get("name") == "mkd::step" and e.get("cat") == "user_annotation"]
    if not window:
        raise ValueError(f"{trace_path}: no mkd::step annotation")
    w0, w1 = window[0]["ts"], window[0]["ts"] + window[0]["dur"]
    threads = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            threads.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
    device, points = [], {}
    if leaf_ops:
        for key, ops in threads.items():
            ops.sort(key=lambda o: (o[0], -(o[1] - o[0])))
            for i, (ts, end, name) in enumerate(ops):
                child = i + 1 < len(ops) and ops[i + 1][0] < end
                if not child and not name.startswith("mkd::") and w0 <= ts <= w1:
                    device.append({"name": name, "ts": ts, "dur": end - ts, "corr": (key, i)})
                    points.setdefault(key, []).append((ts + 1e-3, (key, i)))
    else:
        launch = {}
        for e in events:
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
                launch[e["args"]["correlation"]] = e
        for e in events:
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and w0 <= e["ts"] <= w1:
                c = e.get("args", {}).get("correlation")
                device.append({"name": e["name"], "ts": e["ts"], "dur": e.get("dur", 0), "corr": c})
                ln = launch.get(c)
                if ln is not None:
                    points.setdefault((ln["pid"], ln["tid"]), []).append((ln["ts"], c))
    stacks = {}
    for key, pts in points.items():
        stacks.update(stacks_at(threads.get(key, []), pts))
    cats, top = {}, {}
    for d in device:
        stack = stacks.get(d["corr"], [])
        cat, sub = classify(d["name"], stack)
        c = cats.setdefault(cat, {"us": 0.0, "count": 0, "sub": {}})
        c["us"] += d["dur"]
        c["count"] += 1
        c["sub"][sub] = c["sub"].get(sub, 0.0) + d["dur"]
        t = top.setdefault(cat, {})
        t[d["name"]] = t.get(d["name"], 0.0) + d["dur"]
    iv = sorted((d["ts"], d["ts"] + d["dur"]) for d in device)
    busy, cur = 0.0, None
    for s, e in iv:
        if cur is None or s > cur[1]:
            if cur:
                busy += cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    if cur:
        busy += cur[1] - cur[0]
    wall = w1 - w0
    total = sum(c["us"] for c in cats.values())
    split = {k: {"s": v["us"] / 1e6, "share_of_wall": v["us"] / wall, "kernels": v["count"],
                 "sub_s": {s: u / 1e6 for s, u in sorted(v["sub"].items(), key=lambda x: -x[1])},
                 "top": [{"name": n[:160], "s": u / 1e6} for n, u in sorted(top[k].items(), key=lambda x: -x[1])[:12]]}
             for k, v in sorted(cats.items(), key=lambda x: -x[1]["us"])}
    return {"window_s": wall / 1e6, "device_events": len(device), "kernel_time_sum_s": total / 1e6,
            "busy_union_s": busy / 1e6, "idle_s": (wall - busy) / 1e6, "idle_share": (wall - busy) / wall,
            "overlap_s": (total - busy) / 1e6, "launches_without_stack": sum(1 for d in device if d["corr"] not in stacks),
            "split": split}


def install_hooks(profile_iter: int, trace_path: str, cuda: bool, record: dict):
    """Wrap the loop's forward_backward, the optimizer's step and the KD head (annotations and the window only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    import megatron_kd.training.loop as loop
    import megatron_kd.training.step as step
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=acts, record_shapes=False, with_stack=False)
    state = {"n": 0, "window": None}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    fb0 = loop.forward_backward

    def forward_backward(*a, **k):
        if k.get("forward_only"):
            return fb0(*a, **k)
        state["n"] += 1
        if state["n"] == profile_iter:
            sync()
            prof.start()
            state["window"] = record_function("mkd::step")
            state["window"].__enter__()
            record["t0"] = time.perf_counter()
        elif state["n"] == profile_iter + 1 and state["window"] is not None:
            sync()
            record["window_wall_s"] = time.perf_counter() - record["t0"]
            state["window"].__exit__(None, None, None)
            prof.stop()
            t = time.perf_counter()
            prof.export_chrome_trace(trace_path)
            record["export_s"] = time.perf_counter() - t
        return fb0(*a, **k)
    loop.forward_backward = forward_backward

    bo0 = loop.build_optimizer

    def build_optimizer(*a, **k):
        opt = bo0(*a, **k)
        step0 = opt.step

        def annotated_step(*x, **y):
            with record_function("mkd::optimizer"):
                return step0(*x, **y)
        opt.step = annotated_step
        return opt
    loop.build_optimizer = build_optimizer

    call0 = step.KDHead.__call__

    def kd_head(self, hidden, weight):
        with record_function("mkd::kd_loss"):
            return call0(self, hidden, weight)
    step.KDHead.__call__ = kd_head


def plot(res, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    a = res["profile"]
    parts = [(k, v["s"]) for k, v in a["split"].items()] + [("idle", a["idle_s"])]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.4]})
    left = 0.0
    for k, s in parts:
        ax[0].barh([0], [s], left=left, label=f"{k} {s:.3f} s")
        left += s
    if res.get("target_step_s"):
        ax[0].axvline(res["target_step_s"], color="k", ls="--", label=f"600 TFLOP/s: {res['target_step_s']:.3f} s")
    ax[0].set(yticks=[], xlabel="seconds (kernel time by category; overlap makes the sum exceed the wall)",
              title=f"one step: window {a['window_s']:.3f} s, unprofiled {res.get('step_s_unprofiled') or 0:.3f} s")
    ax[0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
    subs = [(f"{k}:{s}", v) for k, c in a["split"].items() for s, v in c["sub_s"].items()]
    subs = sorted(subs, key=lambda x: -x[1])[:16]
    ax[1].barh([n for n, _ in subs][::-1], [v for _, v in subs][::-1])
    ax[1].set(xlabel="seconds", title="category:subclass")
    ax[1].tick_params(axis="y", labelsize=7)
    fig.suptitle(res.get("title", ""))
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=RECIPE)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--profile-iter", type=int, default=6)
    p.add_argument("--work", default=None)
    p.add_argument("--keep-trace", action="store_true", help="write the trace (gzip) beside --out")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--analyze", help="only analyze this trace (a finished run's); --leaf-ops for a CPU trace")
    p.add_argument("--leaf-ops", action="store_true")
    p.add_argument("--out")
    p.add_argument("overrides", nargs="*", help="more Hydra overrides of the recipe")
    a = p.parse_args()
    if a.analyze:
        print(json.dumps(analyze(a.analyze, a.leaf_ops), indent=1)[:20000])
        return 0
    if a.profile_iter + 1 > a.iters:
        raise SystemExit(f"--profile-iter {a.profile_iter} needs --iters >= {a.profile_iter + 1}")
    import torch
    from common import environment, train_records
    cuda = torch.cuda.is_available()
    a.work = a.work or tempfile.mkdtemp(prefix="fp8_step_profile_")
    out = a.out or os.path.join(a.work, "result.json")
    trace = os.path.join(a.work, "trace.json")
    save = os.path.join(a.work, "run")
    recipe = "tiny_cpu" if a.smoke else a.recipe
    args = ["train", "--config-name", recipe, f"train.iters={a.iters}", f"train.save={save}", f"hydra.run.dir={save}",
            *QUIET]
    if not a.smoke:
        args += ["data.kind=mock", "data.path=null", "train.global_batch_size=1", "train.lr_warmup_iters=0",
                 "kd.build_cache=true", f"kd.cache={os.path.join(a.work, 'cache')}"]
    args += a.overrides
    res = {"benchmark": "one training step under torch.profiler, split", "env": environment(), "args": vars(a),
           "command": "megatron-kd " + " ".join(args), "rule": "The rule" + __doc__.split("The rule")[1].split("\n\n")[0]}
    record = {}
    install_hooks(a.profile_iter, trace, cuda, record)
    from megatron_kd.cli.main import main as cli_main
    t = time.time()
    rc = cli_main(args)
    res.update(rc=rc, wall_s=round(time.time() - t, 1), record=record)
    times, tfl = {}, {}
    for r in train_records(save):
        times[r["iteration"]] = r["step_s"]
        tfl[r["iteration"]] = r.get("tflops_per_gpu")
    clean = [i for i in sorted(times) if 2 <= i < a.profile_iter or i > a.profile_iter + 1]
    res["step_s_all"] = [times[i] for i in sorted(times)]
    if clean:
        res["step_s_unprofiled"] = statistics.median(times[i] for i in clean)
        res["tflops_unprofiled"] = statistics.median(tfl[i] for i in clean if tfl[i] is not None) if cuda else None
        if res["tflops_unprofiled"]:
            flops = res["tflops_unprofiled"] * 1e12 * res["step_s_unprofiled"]
            res["flops_per_step"] = flops
            res["target_step_s"] = flops / 600e12  # the step time 600 TFLOP/s needs
            res["gap_to_600_s"] = res["step_s_unprofiled"] - res["target_step_s"]
    sp = os.path.join(save, "summary.json")
    if os.path.exists(sp):
        res["summary"] = json.load(open(sp))
    if os.path.exists(trace):
        res["trace_mb"] = round(os.path.getsize(trace) / 2**20, 1)
        t = time.time()
        res["profile"] = analyze(trace, leaf_ops=not cuda)
        res["analyze_s"] = round(time.time() - t, 1)
        if a.keep_trace:
            with open(trace, "rb") as f, gzip.open(os.path.splitext(out)[0] + "_trace.json.gz", "wb") as g:
                g.write(f.read())
    res["title"] = f"{recipe}, iteration {a.profile_iter} of {a.iters}, " + (
        torch.cuda.get_device_name() if cuda else "CPU")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    if "profile" in res:
        try:
            plot(res, os.path.splitext(out)[0] + ".png")
        except Exception as e:  # the figures are in the JSON
            print(f"plot: {type(e).__name__}: {e}")
        brief = {k: v for k, v in res.items() if k in ("rc", "step_s_unprofiled", "tflops_unprofiled",
                                                       "target_step_s", "gap_to_600_s", "record", "trace_mb")}
        prof = res["profile"]
        brief["profile"] = {k: v for k, v in prof.items() if k != "split"}
        brief["split"] = {k: {"s": round(v["s"], 4), "sub_s": {s: round(x, 4) for s, x in v["sub_s"].items()}}
                          for k, v in prof["split"].items()}
        print(json.dumps(brief, indent=1, default=str))
    return 0 if rc == 0 and "profile" in res else 1


if __name__ == "__main__":
    sys.exit(main())
