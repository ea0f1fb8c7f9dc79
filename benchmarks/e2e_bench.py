"""End-to-end benchmark: `megatron-kd train` itself (the CLI, Hydra recipe tiny_cpu + overrides, mock data, a random
teacher whose top-K cache is built first), with the planner's prediction next to each run (--plan).

Runs, each a `megatron-kd train` process on the GPUs of this machine (or CPU with --size smoke):
  1gpu_offline   offline KD from the cache: Float16Module + Megatron DDP + DistributedOptimizer (bf16),
                 get_forward_backward_func, our hook (no logits) + topk_kl_loss impl auto (fused with Triton)
  1gpu_resume    the same run stopped at iteration --iters/3 and resumed: losses vs 1gpu_offline
  1gpu_online    the teacher in memory, top-K on the fly: losses vs 1gpu_offline (fp16 cache rounding apart)
  1gpu_ce        CE only (the throughput baseline of the same student)
  2gpu_tp2 / 2gpu_pp2 / 2gpu_dp2   (two or more GPUs) TP=2, PP=2 (1F1B), DP=2: all offline on the same cache
Sizes: smoke (CPU, fp32, tiny), small (12 x 1024 student at 4K), 3b (the Llama-3.2-3B shape, vocab 128256, full
recompute, --seq tokens; teacher of the same shape). --runs picks a subset. With --plan every run also records
megatron_kd.plan's predicted peak for the same recipe and overrides (plan.recipe.load_recipe -> plan_memory) and
predicted / measured (torch.cuda.max_memory_allocated, summary.json's peak_mem_gib; on CPU the peak RSS, no ratio).
Writes one JSON: each run's summary.json, per-iteration losses, wall time, the prediction, and the checks.

GPU (needs megatron-core + hydra-core/omegaconf/antlr4 carried as wheels, PYTHONPATH=/tmp/site:$PWD):
  python benchmarks/e2e_bench.py --size small --plan --out benchmarks/results/e2e_small_h200.json     # ~5 min
  python benchmarks/e2e_bench.py --size 3b --seq 32768 --runs 1gpu_offline 1gpu_ce --plan \
      --out benchmarks/results/e2e_3b_32k_h200.json                                                    # ~6 min
CPU smoke: python benchmarks/e2e_bench.py --size smoke --plan --runs 1gpu_offline --out /tmp/e2e.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def arch(prefix, layers, hidden, heads, groups, ffn):
    return [f"{prefix}.num_layers={layers}", f"{prefix}.hidden_size={hidden}", f"{prefix}.num_attention_heads={heads}",
            f"{prefix}.num_query_groups={groups}", f"{prefix}.ffn_hidden_size={ffn}",
            f"{prefix}.make_vocab_size_divisible_by=128", f"{prefix}.attention_backend=auto"]


def settings(size: str, seq=None):
    if size == "smoke":
        s = dict(student=arch("model", 2, 64, 4, 2, 192), teacher=arch("teacher", 2, 96, 4, 4, 256), vocab=2048,
                 seq=128, mbs=2, gbs=4, iters=12, k=16, precision="fp32")
    elif size == "small":
        s = dict(student=arch("model", 12, 1024, 16, 8, 4096), teacher=arch("teacher", 16, 1536, 16, 8, 6144),
                 vocab=32000, seq=4096, mbs=1, gbs=8, iters=30, k=100, precision="bf16")
    else:  # the Llama-3.2-3B shape (tied embeddings), full recompute; the random teacher has the same shape
        full = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
        s = dict(student=arch("model", 28, 3072, 24, 8, 8192) + ["model.kv_channels=128"] + full,
                 teacher=arch("teacher", 28, 3072, 24, 8, 8192) + ["teacher.kv_channels=128"], vocab=128256,
                 seq=8192, mbs=1, gbs=1, iters=12, k=100, precision="bf16")
    if seq:
        s["seq"] = seq
    return s


def predicted_peak_gib(args, nproc):
    """megatron_kd.plan's peak (GiB, the worst stage) for the recipe and overrides of one run."""
    from megatron_kd.plan import plan_memory
    from megatron_kd.plan.recipe import from_recipe, load_recipe
    ov = [o for o in args[2:] if not o.startswith("hydra.")]
    rp = from_recipe(load_recipe(args[1], ov))
    lay = rp.layout
    layout = type(lay)(**{**vars(lay), "dp": nproc // (lay.tp * lay.pp * lay.cp)})
    return plan_memory(rp.shape, layout, rp.training_for(layout)).peak_gib


def overrides(s, save, *extra):
    return ["--config-name", "tiny_cpu", "data=mock", f"data.vocab_size={s['vocab']}", f"data.seq_length={s['seq']}",
            f"train.micro_batch_size={s['mbs']}", f"train.global_batch_size={s['gbs']}", f"train.iters={s['iters']}",
            f"train.precision={s['precision']}", "train.progress=false", "train.log_interval=1",
            "train.eval_interval=null", "train.save_interval=null", "train.lr_warmup_iters=2",
            f"kd.top_k={s['k']}", *s["student"], *s["teacher"], f"train.save={save}", f"hydra.run.dir={save}", *extra]


def run(nproc, args, log):
    if nproc == 1:
        cmd = [sys.executable, "-m", "megatron_kd", "train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "megatron_kd", "train", *args]
    # a fresh process group each run: no rank / rendezvous inherited from the caller (a test process that ran
    # `megatron-kd train` in-process still holds the port its MASTER_PORT names)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    t = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    return rc, time.time() - t


def losses(save):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import train_records
    return {r["iteration"]: r["loss"] for r in train_records(save)}


def max_rel(a, b):
    common = sorted(set(a) & set(b))
    return max((abs(a[i] - b[i]) / max(1e-6, abs(b[i])) for i in common), default=None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", choices=("smoke", "small", "3b"), default="small")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sample (default: the size's)")
    ap.add_argument("--runs", nargs="*", default=None, help="only these runs (default: all that fit the GPUs)")
    ap.add_argument("--plan", action="store_true", help="record the planner's predicted peak next to each run")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    import torch
    gpus = torch.cuda.device_count()
    s = settings(a.size, a.seq)
    work = a.workdir or tempfile.mkdtemp(prefix="e2e_bench_")
    os.makedirs(work, exist_ok=True)
    cache = os.path.join(work, "cache")
    plan = [("1gpu_offline", 1, ["kd=offline", f"kd.cache={cache}", "kd.build_cache=true"]),
            ("1gpu_resume_part", 1, ["kd=offline", f"kd.cache={cache}", f"train.stop_at={max(1, s['iters'] // 3)}"]),
            ("1gpu_resume", 1, ["kd=offline", f"kd.cache={cache}"]),
            ("1gpu_online", 1, ["kd=online", f"teacher.load={os.path.join(work, 'teacher_ckpt')}"]),
            ("1gpu_ce", 1, ["kd=ce"])]
    if gpus >= 2:
        plan += [("2gpu_tp2", 2, ["kd=offline", f"kd.cache={cache}", "parallel.tp=2"]),
                 ("2gpu_pp2", 2, ["kd=offline", f"kd.cache={cache}", "parallel.pp=2"]),
                 ("2gpu_dp2", 2, ["kd=offline", f"kd.cache={cache}"])]
    if a.runs:
        unknown = set(a.runs) - {n for n, _, _ in plan} - {"1gpu_resume"}
        if unknown:
            ap.error(f"unknown or unavailable runs {sorted(unknown)}")
        plan = [r for r in plan if r[0] in a.runs or (r[0] == "1gpu_resume_part" and "1gpu_resume" in a.runs)]
        if not any(n == "1gpu_offline" for n, _, _ in plan) and any(n != "1gpu_ce" for n, _, _ in plan):
            plan.insert(0, ("1gpu_offline", 1, ["kd=offline", f"kd.cache={cache}", "kd.build_cache=true"]))
    results = {"gpus": gpus, "size": a.size, "settings": {k: v for k, v in s.items()}, "runs": {}}
    # The random teacher the cache came from, saved once so the online run uses the same weights: train it 1 step
    # at lr 0 (a CE run) with the teacher's architecture as the model.
    teacher_model = [o.replace("teacher.", "model.", 1) for o in s["teacher"]]
    t_save = os.path.join(work, "teacher_ckpt")
    rc, dt = run(1, overrides({**s, "iters": 1}, t_save, "kd=ce", "train.lr=0", "train.min_lr=0", *teacher_model),
                 os.path.join(work, "teacher.log"))
    results["runs"]["teacher_ckpt"] = {"rc": rc, "wall_s": dt}
    for name, nproc, extra in plan:
        save = os.path.join(work, name.replace("_part", ""))
        if name.startswith("1gpu_offline") or name.startswith("1gpu_resume") or name.startswith("2gpu"):
            extra = extra + [f"teacher.load={t_save}"]
        rc, dt = run(nproc, overrides(s, save, *extra), os.path.join(work, name + ".log"))
        summary = json.load(open(os.path.join(save, "summary.json"))) if os.path.exists(
            os.path.join(save, "summary.json")) else None
        results["runs"][name] = {"rc": rc, "wall_s": dt, "summary": summary, "losses": losses(save),
                                 "log": os.path.join(work, name + ".log")}
        if a.plan:
            pred = predicted_peak_gib(overrides(s, save, *extra), nproc)
            measured = summary and summary.get("peak_mem_gib")
            results["runs"][name]["plan"] = {"predicted_peak_gib": pred, "measured_peak_gib": measured,
                                             "predicted_over_measured": pred / measured
                                             if (measured and summary.get("device") == "cuda") else None}
            print(f"  plan: predicted peak {pred:.2f} GiB" + (f", measured {measured:.2f} GiB" if measured else ""))
        print(f"{name}: rc={rc} {dt:.0f}s " + ("" if not summary else
              f"{summary['tokens_per_s']:.0f} tok/s {summary['tflops_per_gpu']:.1f} TFLOP/s/GPU "
              f"peak {summary['peak_mem_gib']:.1f} GiB loss {summary['loss']:.4f}"), flush=True)
    r = results["runs"]
    ref = r["1gpu_offline"]["losses"] if "1gpu_offline" in r else {}
    results["checks"] = {f"{n}_vs_1gpu_offline_max_rel_loss_diff": max_rel(r[n]["losses"], ref)
                         for n in r if n in ("1gpu_resume", "1gpu_online") or n.startswith("2gpu")}
    print(json.dumps(results["checks"], indent=2))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)
    return 0 if all(v["rc"] == 0 for v in r.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
