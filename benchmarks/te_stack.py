"""The users' stack on one GPU: Transformer Engine importable, as in NeMo / Megatron-Bridge containers, beside the
SDPA path without TE, all in one call; each arm a `megatron-kd train` process of the real CLI.

Parts (--parts picks; each writes into one JSON, rewritten after every arm so a cut run keeps what finished):
  user    the 32K user path, recipe llama31_8b_to_3b_32k_1xh200 (mock data, lean_adam, --iters iterations), no override
          of the backend or fusions; for each --recompute count R (layers recomputed), arms named *_rR:
            sdpa_no_te      TE not importable (its folder off PYTHONPATH): auto -> SDPA; the first builds the cache
            te_bf16         TE importable: auto -> TE's spec; the first also builds a cache with a TE teacher
            te_fp8[_RECIPE] TE, model.fp8=hybrid model.fp8_recipe=RECIPE, one arm per --fp8-arms RECIPE:R (:dpa adds
                            TE's FP8 attention: model.fp8_attention=true)
            sdpa_te_user    TE importable, model.attention_backend=sdpa, torch's cuDNN NOT first on LD_LIBRARY_PATH
                            (what a pip install of TE gives): megatron-kd's restart puts it first
            sdpa_te_clash   (--clash-arm) the same with the restart off (MEGATRON_KD_NO_CUDNN_REEXEC=1)
          the two caches are compared position by position only when their teachers' weights are equal.
          Each arm's TFLOP/s is also given over the SDPA arm at its R (or at the first R).
  gptoss  GPT-OSS-20B's architecture cut to 4 layers at 32K under TE (TE's layers, megatron-kd's sink / window
          attention) with the recipe's expert setting (moe_grouped_gemm=true: TE's grouped GEMM) and with sequential
          experts, beside the SDPA path without TE; offline KD from a 2-layer teacher.
  fp8     a 1.07 B student (22 layers, hidden 2048) trained 200 steps on real text (pydoc, --data PREFIX) with CE, bf16 vs FP8 (TE both;
          --fp8-curve RECIPE[:dpa]; --bf16-second-seed N adds bf16 at another seed, the spread bf16 has by itself,
          and --fp8-second-seed FP8 at that seed too, a second pair; --eval-iters: held-out micro-batches),
          held-out loss every 25 steps; a PNG of both curves (--plot-only draws it from the JSON afterwards), and
          the check: held-out CE of FP8 within 2% of bf16's at every evaluation and 0.5% at the last.

  source .whlte/device_install.sh && python3 benchmarks/te_stack.py --te-site /tmp/te_site --data .te_data/pydoc_text_document \
      --out $OUT/te_stack_h200.json
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from long_context import cli, env_info, last, out_write, step_times  # noqa: E402

RECIPE = "llama31_8b_to_3b_32k_1xh200"
QUIET = ["train.eval_iters=0", "train.eval_interval=null", "train.save_interval=null", "train.save_at_end=false",
         "train.log_interval=1", "train.progress=true", "train.tensorboard=false"]


def envs(te_site):
    """{name: environment}: TE importable or not; torch's cuDNN first on LD_LIBRARY_PATH or not."""
    base = dict(os.environ)
    path = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    no_te = dict(base, PYTHONPATH=os.pathsep.join(p for p in path if os.path.abspath(p) != os.path.abspath(te_site)))
    ld = [p for p in base.get("LD_LIBRARY_PATH", "").split(":") if p]
    user = dict(base, LD_LIBRARY_PATH=":".join(p for p in ld if "nvidia/cudnn" not in p))
    user.pop("MEGATRON_KD_NO_CUDNN_REEXEC", None)
    return {"no_te": no_te, "te": base, "te_user": user, "te_clash": dict(user, MEGATRON_KD_NO_CUDNN_REEXEC="1")}


def run_arm(name, args, env, a, out, deadline):
    save = os.path.join(a.scratch, name)
    args = [*args, f"train.save={save}", f"hydra.run.dir={save}"]
    r = out["arms"][name] = {"command": "megatron-kd train " + " ".join(args)}
    print(f"[{name}] {r['command']}", flush=True)
    log = os.path.join(a.scratch, f"{name}.log")
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        rc, dt = cli(["train", *args], log, min(a.arm_s, deadline - time.time()))
    finally:
        os.environ.clear()
        os.environ.update(old)
    text = open(log, errors="replace").read()
    sp = os.path.join(save, "summary.json")
    s = json.load(open(sp)) if os.path.exists(sp) else {}
    r.update(rc=rc, wall_s=round(dt, 1), peak_gib=s.get("peak_mem_gib"), tflops=s.get("tflops_per_gpu"),
             tokens_per_s=s.get("tokens_per_s"), step_s=s.get("step_s"), step_s_all=step_times(save), loss=s.get("loss"),
             cache_build_tokens_per_s=last(r"([\d,]+) tokens/s \(all ranks\)", text),
             notes=[ln for ln in text.splitlines() if ln.startswith("note:")][:8],
             summary_line=next((ln for ln in text.splitlines() if ln.startswith("megatron-kd train: ")), None))
    evals = []
    mp = os.path.join(save, "metrics.jsonl")
    if os.path.exists(mp):
        for line in open(mp):
            rec = json.loads(line)
            if rec.get("kind") in ("eval", "valid"):
                evals.append(rec)
        r["train_loss"] = [json.loads(line).get("loss") for line in open(mp) if '"kind": "train"' in line]
    r["evals"] = evals
    if rc != 0:
        r["error_tail"] = text[-3000:]
    out_write(a.out, out)
    print(f"[{name}] rc={rc} {dt:.0f}s: {r['summary_line']} peak {r['peak_gib']}", flush=True)
    for n in r["notes"]:
        print(f"[{name}]   {n[:300]}", flush=True)
    return r


def compare_caches(a, b):
    """Position-by-position comparison of two top-K caches of the same samples."""
    import numpy as np
    from megatron_kd.cache.reader import CacheReader
    ra, rb = CacheReader(a), CacheReader(b)
    wa, wb = (r.manifest.get("teacher", {}).get("weights_hash") for r in (ra, rb))
    if wa != wb:  # two random inits: the caches differ by their weights, not by the kernels
        return {"comparable": False, "why": f"different teacher weights ({wa} vs {wb})",
                "teacher_a": ra.manifest.get("teacher"), "teacher_b": rb.manifest.get("teacher")}
    top1, overlap, dlp, kl = [], [], [], []
    for i in range(min(len(ra), len(rb))):
        x, y = ra.read(i), rb.read(i)
        ia, ib, la, lb = x["topk_ids"], y["topk_ids"], x["topk_logprobs"], y["topk_logprobs"]
        top1.append(float((ia[:, 0] == ib[:, 0]).mean()))
        for p in range(0, ia.shape[0], 256):  # every 256th position: enough for the statistics, fast
            sa, sb = dict(zip(ia[p].tolist(), la[p].tolist())), dict(zip(ib[p].tolist(), lb[p].tolist()))
            common = set(sa) & set(sb)
            overlap.append(len(common) / max(len(sa), 1))
            dlp += [abs(sa[k] - sb[k]) for k in common]
            kl.append(sum(np.exp(sa[k]) * (sa[k] - sb[k]) for k in common))
    return dict(samples=min(len(ra), len(rb)), top1_agreement=statistics.mean(top1),
                id_overlap_mean=statistics.mean(overlap), id_overlap_min=min(overlap),
                logprob_absdiff_mean=float(np.mean(dlp)), logprob_absdiff_p99=float(np.percentile(dlp, 99)),
                logprob_absdiff_max=float(np.max(dlp)), kl_on_common_ids_mean=float(np.mean(kl)),
                teacher_a=ra.manifest.get("teacher"), teacher_b=rb.manifest.get("teacher"))


def part_user(a, out, E, deadline):
    c1, c2 = os.path.join(a.scratch, "cache_sdpa"), os.path.join(a.scratch, "cache_te")
    base = ["--config-name", RECIPE, "data.kind=mock", "data.path=null", f"train.iters={a.iters}",
            "train.global_batch_size=1",
            "train.lr_warmup_iters=0", "train.optimizer=lean_adam", *QUIET]

    def fp8(recipe):
        return ["model.fp8=hybrid", f"model.fp8_recipe={recipe}"]

    r0 = a.recompute[0]
    run_arm(f"sdpa_no_te_r{r0}", [*base, f"model.recompute_num_layers={r0}", "kd.build_cache=true", f"kd.cache={c1}"],
            E["no_te"], a, out, deadline)
    if a.te_cache:  # the TE teacher writes its own cache: the teacher pass under TE's spec (its own random weights)
        run_arm(f"te_bf16_r{r0}", [*base, f"model.recompute_num_layers={r0}", "kd.build_cache=true",
                                   f"kd.cache={c2}"], E["te"], a, out, deadline)
        if os.path.isdir(c1) and os.path.isdir(c2):
            try:
                out["cache_te_vs_sdpa"] = compare_caches(c1, c2)
            except Exception as e:  # noqa: BLE001
                out["cache_te_vs_sdpa"] = {"error": repr(e)}
        shutil.rmtree(c2, ignore_errors=True)
    else:
        run_arm(f"te_bf16_r{r0}", [*base, f"model.recompute_num_layers={r0}", f"kd.cache={c1}"], E["te"], a, out,
                deadline)
    for r in a.recompute[1:]:
        run_arm(f"sdpa_no_te_r{r}", [*base, f"model.recompute_num_layers={r}", f"kd.cache={c1}"], E["no_te"], a, out,
                deadline)
        run_arm(f"te_bf16_r{r}", [*base, f"model.recompute_num_layers={r}", f"kd.cache={c1}"], E["te"], a, out,
                deadline)
    for arm in a.fp8_arms:  # RECIPE:R[:exp][:dpa], e.g. tensorwise:6, delayed:4:exp
        recipe, r, *more = arm.split(":")
        name = (f"te_fp8_r{r}" if recipe == "tensorwise" else f"te_fp8_{recipe}_r{r}") + "".join(f"_{m}" for m in more)
        env = dict(E["te"], PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True") if "exp" in more else E["te"]
        dpa = ["model.fp8_attention=true"] if "dpa" in more else []
        run_arm(name, [*base, f"model.recompute_num_layers={r}", f"kd.cache={c1}", *fp8(recipe), *dpa], env, a, out,
                deadline)
    if a.sdpa_te_arm:
        sdpa = [*base, f"model.recompute_num_layers={r0}", f"kd.cache={c1}", "model.attention_backend=sdpa"]
        run_arm(f"sdpa_te_user_r{r0}", sdpa, E["te_user"], a, out, deadline)
        if a.clash_arm:
            run_arm(f"sdpa_te_clash_r{r0}", sdpa, E["te_clash"], a, out, deadline)
    arms = out["arms"]
    for k, v in arms.items():
        r = k.rsplit("_r", 1)[-1]
        r = r.split("_")[0]
        ref = (arms.get(f"sdpa_no_te_r{r}") or arms.get(f"sdpa_no_te_r{r0}") or {}).get("tflops")
        if ref and v.get("tflops") and not k.startswith("sdpa_no_te"):
            v["tflops_over_sdpa_no_te"] = round(v["tflops"] / ref, 4)
            v["sdpa_no_te_baseline"] = f"sdpa_no_te_r{r}" if arms.get(f"sdpa_no_te_r{r}") else f"sdpa_no_te_r{r0}"
    out_write(a.out, out)


def part_gptoss(a, out, E, deadline):
    cache = os.path.join(a.scratch, "cache_gptoss")
    base = ["--config-name", "gpt_oss_20b_32k_8xh200", "parallel.ep=1", "parallel.tp=1", "parallel.cp=1",
            "parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false", "data.num_workers=0",
            "model.num_layers=4",
            "teacher.num_layers=2", "teacher.num_moe_experts=32", "data.kind=mock", "data.path=null",
            "train.iters=8", "train.global_batch_size=1", "train.micro_batch_size=1", "train.lr_warmup_iters=0",
            "model.recompute_granularity=null", "model.recompute_method=null", "model.recompute_num_layers=null",
            *QUIET]  # 8 iterations: the first 3-4 still compile / warm up (FlexAttention, MoE)
    run_arm("gptoss_te_recipe", [*base, "kd.build_cache=true", f"kd.cache={cache}"], E["te"], a, out, deadline)
    run_arm("gptoss_te_sequential", [*base, f"kd.cache={cache}", "model.moe_grouped_gemm=false"], E["te"], a, out,
            deadline)
    run_arm("gptoss_sdpa_no_te", [*base, f"kd.cache={cache}"], E["no_te"], a, out, deadline)
    shutil.rmtree(cache, ignore_errors=True)


def part_fp8(a, out, E, deadline):
    shape = ["model.num_layers=22", "model.hidden_size=2048", "model.num_attention_heads=16",
             "model.num_query_groups=8", "model.kv_channels=128", "model.ffn_hidden_size=5632",
             "model.tie_embeddings=false",
             "model.recompute_granularity=null", "model.recompute_method=null", "model.recompute_num_layers=null"]
    tok = os.path.join(os.path.dirname(a.data), "tokenizer.json")
    base = ["--config-name", RECIPE, "kd=ce", "data=pydoc", f"data.path={a.data}", f"data.tokenizer={tok}",
            "data.seq_length=2048", "train.iters=200", "train.global_batch_size=8", "train.micro_batch_size=4", "train.lr=3e-4", "train.min_lr=3e-5",
            "train.lr_warmup_iters=20", "train.optimizer=adam", "train.eval_interval=25",
            f"train.eval_iters={a.eval_iters}",
            "train.save_interval=null", "train.save_at_end=false", "train.log_interval=1", "train.progress=false",
            "train.tensorboard=false", *shape]
    run_arm("fp8_curve_bf16", base, E["te"], a, out, deadline)
    recipe, *more = a.fp8_curve.split(":")
    dpa = ["model.fp8_attention=true"] if "dpa" in more else []
    out["fp8_curve_recipe"] = a.fp8_curve
    if a.bf16_second_seed is not None:  # bf16 against bf16: how far two seeds' curves lie apart anyway
        run_arm("fp8_curve_bf16_seed2", [*base, f"train.seed={a.bf16_second_seed}"], E["te"], a, out, deadline)
    run_arm("fp8_curve_fp8", [*base, "model.fp8=hybrid", f"model.fp8_recipe={recipe}", *dpa], E["te"], a, out,
            deadline)
    if a.bf16_second_seed is not None and a.fp8_second_seed:  # FP8 at the second seed too: a second pair
        run_arm("fp8_curve_fp8_seed2", [*base, f"train.seed={a.bf16_second_seed}", "model.fp8=hybrid",
                                        f"model.fp8_recipe={recipe}", *dpa], E["te"], a, out, deadline)


FP8_TOL_EVERY, FP8_TOL_END = 0.02, 0.005  # |FP8 - bf16| / bf16 held-out CE: at every evaluation, at the last


def fp8_curves(out, png):
    """The FP8 part's check (held-out CE of FP8 against bf16 at each evaluation) and a PNG of both curves."""
    a, b = out["arms"].get("fp8_curve_bf16", {}), out["arms"].get("fp8_curve_fp8", {})
    ea, eb = ({e["iteration"]: e["ce"] for e in x.get("evals", [])} for x in (a, b))
    steps = sorted(set(ea) & set(eb))
    if not steps:
        return None
    rel = {i: (eb[i] - ea[i]) / ea[i] for i in steps}
    check = {"steps": len(a.get("train_loss") or []), "eval_iterations": steps,
             "heldout_ce_bf16": [ea[i] for i in steps], "heldout_ce_fp8": [eb[i] for i in steps],
             "rel_diff": [rel[i] for i in steps], "max_abs_rel_diff": max(abs(v) for v in rel.values()),
             "final_rel_diff": rel[steps[-1]], "tolerance_every_eval": FP8_TOL_EVERY, "tolerance_final": FP8_TOL_END,
             "tflops_bf16": a.get("tflops"), "tflops_fp8": b.get("tflops"),
             "peak_gib_bf16": a.get("peak_gib"), "peak_gib_fp8": b.get("peak_gib")}
    check["met"] = check["max_abs_rel_diff"] <= FP8_TOL_EVERY and abs(check["final_rel_diff"]) <= FP8_TOL_END
    ec = {e["iteration"]: e["ce"] for e in out["arms"].get("fp8_curve_bf16_seed2", {}).get("evals", [])}
    if set(steps) <= set(ec):  # the spread of bf16 itself over a second seed, the yardstick for FP8's difference
        spread = [(ec[i] - ea[i]) / ea[i] for i in steps]
        check.update(bf16_seed_rel_diff=spread, bf16_seed_max_abs_rel_diff=max(abs(v) for v in spread),
                     bf16_seed_final_rel_diff=spread[-1])
        ef = {e["iteration"]: e["ce"] for e in out["arms"].get("fp8_curve_fp8_seed2", {}).get("evals", [])}
        if set(steps) <= set(ef):  # the second pair (both at the second seed): is FP8's difference the same?
            pair2 = [(ef[i] - ec[i]) / ec[i] for i in steps]
            check.update(seed2_rel_diff=pair2, seed2_final_rel_diff=pair2[-1],
                         mean_final_rel_diff=(check["final_rel_diff"] + pair2[-1]) / 2)
    out["fp8_check"] = check
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    recipe, *more = out.get("fp8_curve_recipe", "tensorwise").split(":")
    label = f"FP8 (hybrid, {recipe}{', FP8 attention' if 'dpa' in more else ''})"
    seed2 = out["arms"].get("fp8_curve_bf16_seed2")
    f8s2 = out["arms"].get("fp8_curve_fp8_seed2")
    for arm, name in ((a, "bf16"), (b, label), *([(seed2, "bf16, second seed")] if seed2 else []),
                      *([(f8s2, f"{label}, second seed")] if f8s2 else [])):
        tl = arm.get("train_loss") or []
        w = 10
        sm = [sum(tl[max(0, i - w + 1):i + 1]) / len(tl[max(0, i - w + 1):i + 1]) for i in range(len(tl))]
        ax[0].plot(range(1, len(sm) + 1), sm, label=name)
        ev = {e["iteration"]: e["ce"] for e in arm.get("evals", [])}
        ax[1].plot(sorted(ev), [ev[i] for i in sorted(ev)], marker="o", label=name)
    ax[0].set(xlabel="step", ylabel="train loss (CE, mean of 10 steps)", title="train")
    ax[1].set(xlabel="step", ylabel="held-out CE", title=f"held-out: FP8 vs bf16 max {check['max_abs_rel_diff']:.2%}"
              f", last {check['final_rel_diff']:+.2%}")
    for x in ax:
        x.legend()
        x.grid(alpha=0.3)
    fig.suptitle("1.07 B student, 200 steps on real text, one H200, TE 2.20")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return check


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--te-site", required=True, help="the folder TE is installed in (taken off PYTHONPATH for no-TE)")
    ap.add_argument("--data", default=".te_data/pydoc_text_document", help="indexed text for the fp8 part")
    ap.add_argument("--parts", nargs="+", default=["user", "gptoss", "fp8"], choices=["user", "gptoss", "fp8"])
    ap.add_argument("--budget-s", type=float, default=560)
    ap.add_argument("--arm-s", type=float, default=150, help="cut one arm at this many seconds")
    ap.add_argument("--iters", type=int, default=4,
                    help="iterations of each user arm (its figure is the median step of iterations 2..N)")
    ap.add_argument("--recompute", type=int, nargs="+", default=[12], help="recomputed layers of the user arms")
    ap.add_argument("--fp8-arms", nargs="*", default=["tensorwise:12"],
                    help="FP8 arms of the user part as RECIPE:R[:exp][:dpa] (model.fp8_recipe, recomputed layers; exp: "
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; dpa: TE's FP8 attention too)")
    ap.add_argument("--fp8-curve", default="tensorwise", help="the fp8 part's FP8 arm as RECIPE[:dpa]")
    ap.add_argument("--fp8-second-seed", action="store_true",
                    help="with --bf16-second-seed: FP8 at that seed too (a second bf16/FP8 pair)")
    ap.add_argument("--eval-iters", type=int, default=4, help="held-out micro-batches per evaluation (fp8 part)")
    ap.add_argument("--bf16-second-seed", type=int, default=None,
                    help="the fp8 part also trains bf16 with this train.seed: the spread of bf16 itself")
    ap.add_argument("--te-cache", action=argparse.BooleanOptionalAction, default=True,
                    help="the first TE arm also builds a cache with a TE teacher")
    ap.add_argument("--sdpa-te-arm", action=argparse.BooleanOptionalAction, default=True,
                    help="the SDPA arm with TE importable (torch's cuDNN not first)")
    ap.add_argument("--clash-arm", action="store_true", help="also the arm with the cuDNN restart turned off")
    ap.add_argument("--scratch", default=None)
    ap.add_argument("--plot-only", action="store_true", help="the FP8 check and PNG from --out's JSON (no runs)")
    a = ap.parse_args()
    if a.plot_only:
        out = json.load(open(a.out))
        print(json.dumps(fp8_curves(out, os.path.splitext(a.out)[0] + ".png"), indent=1))
        out_write(a.out, out)
        return 0
    a.scratch = a.scratch or tempfile.mkdtemp(prefix="te_stack_")
    deadline = time.time() + a.budget_s
    out = json.load(open(a.out)) if os.path.exists(a.out) else {"arms": {}}
    out["env"] = env_info()
    E = envs(a.te_site)
    for part in a.parts:
        {"user": part_user, "gptoss": part_gptoss, "fp8": part_fp8}[part](a, out, E, deadline)
    if "fp8" in a.parts:
        try:
            fp8_curves(out, os.path.splitext(a.out)[0] + ".png")
        except ImportError:  # no matplotlib on the machine: --plot-only draws it later
            pass
    out_write(a.out, out)
    shutil.rmtree(a.scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
