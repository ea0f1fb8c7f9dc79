"""The 3.2B student at 131,072 tokens on one GPU through the real CLI, beside the 32K recipe in the same call.

For each recipe (llama31_8b_to_3b_128k_1xh200, then llama31_8b_to_3b_32k_1xh200), in a scratch directory that is
deleted afterwards (the final checkpoint of a 3.2B run is 30-45 GB):
  1. `megatron-kd train --config-name RECIPE data.kind=mock data.path=null kd.build_cache=true kd.cache=SCRATCH/cache
     train.iters=4 train.global_batch_size=1 ...`: the random 8B teacher's top-100 cache over the 4 training
     samples (one full-length forward each), then 4 training iterations of one sample each;
  2. `megatron-kd cache verify SCRATCH/cache` (every shard checksummed);
  3. `megatron-kd plan RECIPE <the same overrides> --json`: the predicted peak beside the measured one.
Recorded per recipe: peak GiB (summary.json's peak_mem_gib: torch.cuda.max_memory_allocated), the plan's peak and
their ratio, model TFLOP/s and tokens/s (the CLI's summary line), s/step (median of iterations 2-4), the cache
build's tokens/s (its progress bar's last figure, all ranks), the verify result, wall times. The JSON is rewritten
after every step, so a run cut short keeps what finished.

    python benchmarks/long_context.py --out benchmarks/results/long_context_h200.json        # one H200, ~8 min
    python benchmarks/long_context.py --smoke --out /tmp/long_context_smoke.json            # CPU, tiny shapes
--smoke runs the same recipes and steps with tiny_cpu-sized overrides (2-layer student and teacher, vocab 2048,
256 / 64 tokens, bf16 for 128K's lean_adam and fp32 for 32K's Megatron Adam on CPU, without recompute: megatron-core's checkpointing needs CUDA).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = [("128k", "llama31_8b_to_3b_128k_1xh200", 131072), ("32k", "llama31_8b_to_3b_32k_1xh200", 32768)]
ITERS = 4


def smoke_overrides(seq: int) -> list:
    """tiny_cpu-sized shapes on the same recipes: the code path of the real run on a CPU in seconds."""
    arch = []
    for s, (layers, hidden, heads, groups, ffn) in (("model", (2, 64, 4, 2, 192)), ("teacher", (2, 96, 4, 4, 256))):
        arch += [f"{s}.num_layers={layers}", f"{s}.hidden_size={hidden}", f"{s}.num_attention_heads={heads}",
                 f"{s}.num_query_groups={groups}", f"{s}.ffn_hidden_size={ffn}", f"{s}.kv_channels={hidden // heads}",
                 f"{s}.attention_backend=sdpa"]
    # megatron-core's activation checkpointing saves the CUDA RNG state: no recompute on a CPU
    return arch + ["model.recompute_granularity=null", "model.recompute_method=null",
                   "model.recompute_num_layers=null", "data.vocab_size=2048", "data.eod_id=2047",
                   f"data.seq_length={seq}", "data.num_workers=0", "train.device=cpu"]


def run_overrides(cache: str, save: str) -> list:
    return ["data.kind=mock", "data.path=null", "kd.build_cache=true", f"kd.cache={cache}", f"train.iters={ITERS}",
            "train.global_batch_size=1", "train.micro_batch_size=1", "train.lr_warmup_iters=0", "train.eval_iters=0",
            "train.eval_interval=null", "train.save_interval=null", "train.save_at_end=false", "train.log_interval=1",
            "train.progress=true",
            "train.tensorboard=false", f"train.save={save}", f"hydra.run.dir={save}"]


def cli(args, log, timeout, err_log=None):
    """`python -m megatron_kd ARGS`, output to `log` (stderr too, unless err_log); (rc, wall seconds). rc 124: cut
    at the time budget."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    t = time.time()
    with open(log, "w") as f, open(err_log or os.devnull, "w") as e:
        try:
            rc = subprocess.call([sys.executable, "-m", "megatron_kd", *args], stdout=f,
                                 stderr=e if err_log else subprocess.STDOUT, cwd=ROOT, env=env, timeout=max(1, timeout))
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.time() - t


def last(pattern, text, cast=float):
    found = re.findall(pattern, text)
    return cast(found[-1].replace(",", "")) if found else None


def step_times(save):
    times = {}
    p = os.path.join(save, "metrics.jsonl")
    if os.path.exists(p):
        for line in open(p):
            r = json.loads(line)
            if r.get("kind") == "train" and r.get("step_s") is not None:
                times[r["iteration"]] = r["step_s"]
    return [times[k] for k in sorted(times)]


def one_recipe(key, recipe, seq, a, deadline, out):
    scratch = tempfile.mkdtemp(prefix=f"long_context_{key}_", dir=a.workdir)
    cache, save = os.path.join(scratch, "cache"), os.path.join(scratch, "run")
    logs = a.logs or scratch
    if a.smoke:
        seq = 256 if key == "128k" else 64
    extra = smoke_overrides(seq) if a.smoke else []
    if a.smoke and key == "32k":  # Megatron's mixed-precision Adam is CUDA-only; lean_adam (128K) runs bf16 on CPU
        extra.append("train.precision=fp32")
    train_args = ["--config-name", recipe, *run_overrides(cache, save), *extra]
    r = out["runs"][key] = {"recipe": recipe, "seq": seq,
                            "command": "megatron-kd train " + " ".join(train_args)}
    try:
        print(f"[{key}] train (cache build + {ITERS} iterations): {r['command']}", flush=True)
        log = os.path.join(logs, f"{key}_train.log")
        rc, dt = cli(["train", *train_args], log, deadline - time.time())
        text = open(log, errors="replace").read()
        summary_path = os.path.join(save, "summary.json")
        s = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
        steps = step_times(save)
        r.update(train_rc=rc, train_wall_s=dt, summary_line=next((ln for ln in text.splitlines()
                                                                  if ln.startswith("megatron-kd train: ")), None),
                 iterations=s.get("iteration"), peak_gib=s.get("peak_mem_gib"), tflops=s.get("tflops_per_gpu"),
                 tokens_per_s=s.get("tokens_per_s"), step_s=s.get("step_s"), step_s_all=steps,
                 loss=s.get("loss"), device=s.get("device"),
                 cache_build_tokens_per_s=last(r"([\d,]+) tokens/s \(all ranks\)", text),
                 cache_build_samples_per_s=last(r"([\d.]+) samples/s, [\d,]+ tokens/s \(all ranks\)", text))
        if rc != 0:
            r["error_tail"] = text[-3000:]
        out_write(a.out, out)
        print(f"[{key}] rc={rc} {dt:.0f}s: {r['summary_line']}", flush=True)
        if os.path.isdir(cache):
            print(f"[{key}] cache verify {cache}", flush=True)
            log = os.path.join(logs, f"{key}_verify.log")
            rc, dt = cli(["cache", "verify", cache], log, deadline - time.time())
            text = open(log, errors="replace").read().strip()
            r.update(verify_rc=rc, verify_wall_s=dt, verify=text.splitlines()[-1] if text else "",
                     cache_bytes=sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs))
            print(f"[{key}] verify rc={rc}: {r['verify']}", flush=True)
        plan_args = ["plan", recipe, *[o for o in train_args[2:] if not o.startswith(("hydra.", "train.save=", "train.save_at_end"))],
                     "--json"]
        log = os.path.join(logs, f"{key}_plan.json")
        rc, _ = cli(plan_args, log, deadline - time.time(), err_log=os.path.join(logs, f"{key}_plan.log"))
        if rc == 0:
            p = json.load(open(log))
            r.update(plan_command="megatron-kd " + " ".join(plan_args), plan_peak_gib=p["peak_gib"],
                     plan_phase=p["peak_phase"], plan_fits=p["fits"])
            if r.get("peak_gib") and r.get("device") == "cuda":
                r["measured_over_plan"] = r["peak_gib"] / p["peak_gib"]
        out_write(a.out, out)
    finally:
        if not a.keep:
            shutil.rmtree(scratch, ignore_errors=True)  # a 3.2B checkpoint: 30-45 GB of the device's disk


def out_write(path, out):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def env_info():
    import platform
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "python": platform.python_version()}
    try:
        import torch
        info.update(torch=torch.__version__, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except Exception as e:  # noqa: BLE001
        info["torch"] = f"unavailable: {e}"
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip()
    except OSError:
        pass
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: the same CLI steps in seconds")
    ap.add_argument("--budget-s", type=float, default=530, help="wall budget for all steps (each is cut at it)")
    ap.add_argument("--only", choices=[k for k, _, _ in RECIPES], help="one recipe only")
    ap.add_argument("--workdir", default=None, help="where the scratch directories go (default: the system tmp)")
    ap.add_argument("--logs", default=None, help="keep the logs here (default: in the scratch, deleted)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directories (cache, checkpoint)")
    a = ap.parse_args()
    if a.logs:
        os.makedirs(a.logs, exist_ok=True)
    deadline = time.time() + a.budget_s
    out = {"env": env_info(), "smoke": a.smoke, "iters": ITERS, "runs": {}}
    for key, recipe, seq in RECIPES:
        if a.only and key != a.only:
            continue
        one_recipe(key, recipe, seq, a, deadline, out)
    runs = out["runs"]
    if "128k" in runs and "32k" in runs:
        t128, t32 = runs["128k"].get("tflops"), runs["32k"].get("tflops")
        out["tflops_128k_over_32k"] = t128 / t32 if t128 and t32 else None
    out_write(a.out, out)
    for key, r in runs.items():
        print(f"{key}: peak {r.get('peak_gib')} GiB (plan {r.get('plan_peak_gib')}), {r.get('tflops')} TFLOP/s, "
              f"{r.get('step_s')} s/step, cache build {r.get('cache_build_tokens_per_s')} tokens/s, verify "
              f"{r.get('verify')!r}")
    ok = all(r.get("train_rc") == 0 and r.get("verify_rc") == 0 for r in runs.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
