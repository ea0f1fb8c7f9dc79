"""Shipped recipes as they run on this GPU, each beside its `megatron-kd plan`: one call, one process per arm.

Each arm is `megatron-kd train --config-name RECIPE` on mock data (the recipe's own model, recompute, optimizer and
FP8 keys; no backend override), --iters iterations of one 32K sample (train.global_batch_size=1), its TFLOP/s the
median step of iterations 2..N; and `megatron-kd plan RECIPE` with the same overrides (--json) for the planned peak.
The first arm also builds the cache the others read (kd.build_cache=true, the recipe's random 8B teacher).
Arms: --arms NAME=RECIPE[,KEY=VALUE...] (extra overrides after the recipe's), e.g.
  h100_bf16=llama31_8b_to_3b_32k_1xh100 h100_fp8=llama31_8b_to_3b_32k_1xh100_fp8
  h100_fp8_r20=llama31_8b_to_3b_32k_1xh100_fp8,model.recompute_num_layers=20
--no-te ARM...: those arms with Transformer Engine off PYTHONPATH (--te-site), so auto picks the SDPA spec.

  source .whlte/device_install.sh && python3 benchmarks/recipe_bench.py --te-site /tmp/site --gpu h100 \
      --arms h100_bf16=llama31_8b_to_3b_32k_1xh100 h100_fp8=llama31_8b_to_3b_32k_1xh100_fp8 --out $OUT/recipes_h100.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from long_context import env_info, out_write  # noqa: E402
from te_stack import QUIET, envs, run_arm  # noqa: E402


def plan(recipe, over, gpu) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "megatron_kd", "plan", recipe, *over, "--json",
                        *(["--gpu", gpu] if gpu else [])], cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        return {"rc": p.returncode, "err": (p.stderr or p.stdout)[-1500:]}
    d = json.loads(p.stdout)
    return {k: d.get(k) for k in ("peak_gib", "peak_phase", "fits", "gpu", "fits_by_gpu", "refusal")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", nargs="+", required=True)
    ap.add_argument("--no-te", nargs="*", default=[], help="arms run without Transformer Engine importable")
    ap.add_argument("--te-site", required=True)
    ap.add_argument("--gpu", default=None, help="`megatron-kd plan --gpu` kind for the fit verdicts")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=560)
    ap.add_argument("--arm-s", type=float, default=200)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scratch", default=None)
    a = ap.parse_args()
    a.scratch = a.scratch or tempfile.mkdtemp(prefix="recipe_bench_")
    deadline = time.time() + a.budget_s
    out = {"arms": {}, "env": env_info(), "args": vars(a)}
    try:
        import torch
        free, total = torch.cuda.mem_get_info()
        out["gpu_mem_total_gib"] = total / 2**30
        out["gpu_name"] = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        out["gpu_mem_total_gib"] = repr(e)
    E = envs(a.te_site)
    cache = os.path.join(a.scratch, "cache")
    for i, spec in enumerate(a.arms):
        name, rest = spec.split("=", 1)
        recipe, *extra = rest.split(",")
        over = ["data.kind=mock", "data.path=null", f"train.iters={a.iters}", "train.global_batch_size=1",
                "train.lr_warmup_iters=0", *QUIET, f"kd.cache={cache}", *extra]
        planned = plan(recipe, [o for o in over if not o.startswith("train.") and not o.startswith("hydra.")]
                       + ["train.global_batch_size=1"], a.gpu)
        args = ["--config-name", recipe, *over, *(["kd.build_cache=true"] if i == 0 else [])]
        r = run_arm(name, args, E["no_te" if name in a.no_te else "te"], a, out, deadline)
        r["recipe"], r["plan"] = recipe, planned
        if r.get("peak_gib") and planned.get("peak_gib"):
            r["peak_over_plan"] = r["peak_gib"] / planned["peak_gib"]
        out_write(a.out, out)
        print(f"[{name}] plan {planned.get('peak_gib')} measured {r.get('peak_gib')} tflops {r.get('tflops')}",
              flush=True)
    out_write(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
