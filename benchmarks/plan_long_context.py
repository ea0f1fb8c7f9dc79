"""`megatron-kd plan` at 64K and 128K tokens: the 3.2B student on one H200 (llama31_8b_to_3b_128k_1xh200, and the
32K recipe stretched) and GPT-OSS-20B on 8xH200 (gpt_oss_20b_32k_8xh200 with data.seq_length overrides), each
the plan command's own JSON (`--json`), plus the cache build's teacher forward at 128K (the planner's
teacher_forward_peak: one no-grad layer's intermediates or one top-K logit chunk, with the bf16 weights).

    python benchmarks/plan_long_context.py --out benchmarks/results/plan_long_context.json   # CPU, ~1 min
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L128, L32, OSS = "llama31_8b_to_3b_128k_1xh200", "llama31_8b_to_3b_32k_1xh200", "gpt_oss_20b_32k_8xh200"

# (what, plan arguments)
CASES = [
    ("3.2B, 128K recipe as written", [L128]),
    ("3.2B, 128K recipe at 64K", [L128, "data.seq_length=65536"]),
    ("3.2B, 128K, 28 of 28 layers recomputed", [L128, "model.recompute_num_layers=28"]),
    ("3.2B, 128K, 25 of 28 recomputed", [L128, "model.recompute_num_layers=25"]),
    ("3.2B, 128K, 24 of 28 recomputed", [L128, "model.recompute_num_layers=24"]),
    ("3.2B, 128K, Megatron Adam instead of lean_adam", [L128, "train.optimizer=adam"]),
    ("3.2B, 32K recipe stretched to 64K", [L32, "data.seq_length=65536"]),
    ("3.2B, 32K recipe stretched to 128K", [L32, "data.seq_length=131072"]),
    ("GPT-OSS-20B 8xH200, 64K, recipe's 16 of 24 recomputed", [OSS, "data.seq_length=65536", "--gpus", "8"]),
    ("GPT-OSS-20B 8xH200, 64K, 20 of 24", [OSS, "data.seq_length=65536", "model.recompute_num_layers=20", "--gpus", "8"]),
    ("GPT-OSS-20B 8xH200, 128K, recipe's 16 of 24", [OSS, "data.seq_length=131072", "--gpus", "8"]),
    ("GPT-OSS-20B 8xH200, 128K, 23 of 24", [OSS, "data.seq_length=131072", "model.recompute_num_layers=23",
                                            "--gpus", "8"]),
    ("GPT-OSS-20B 8xH200, 128K, 24 of 24", [OSS, "data.seq_length=131072", "model.recompute_num_layers=24",
                                            "--gpus", "8"]),
]


def plan(args):
    cmd = [sys.executable, "-m", "megatron_kd", "plan", *args, "--json"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def cache_build_128k():
    """The 8B teacher's no-grad forward at 131,072 tokens, as the planner counts an online teacher's forward."""
    sys.path.insert(0, ROOT)
    from megatron_kd.plan.memory import GIB, Training, teacher_forward_peak
    from megatron_kd.plan.recipe import from_recipe, load_recipe
    from megatron_kd.plan.shapes import param_counts
    rp = from_recipe(load_recipe(L128, ["kd.mode=online"]))
    t, lay = rp.teacher, rp.layout
    tr = Training(seq_len=131072, mode="online", teacher=t, topk=100)
    fwd = teacher_forward_peak(t, lay, tr, 131072)
    weights = 2 * param_counts(t, lay, 0).total
    return {"teacher": t.name, "seq": 131072, "weights_gib": weights / GIB, "forward_peak_gib": fwd / GIB,
            "topk_result_gib": 131072 * 100 * 12 / GIB, "total_gib": (weights + fwd) / GIB,
            "note": "megatron_kd.plan.memory.teacher_forward_peak (one layer's no-grad intermediates x 3 or one "
                    "top-K logit chunk, whichever is larger, + the hidden states) + bf16 weights"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "plan_long_context.json"))
    a = ap.parse_args()
    rows = []
    for what, args in CASES:
        p = plan(args)
        rc = p["training"]
        items = {i["name"]: round(i["gib"], 2) for i in p["items"] if i["gib"]}
        row = {"what": what, "command": "megatron-kd plan " + " ".join(args), "seq": rc["seq_len"],
               "gpus": p["layout"]["dp"] * p["layout"]["tp"] * p["layout"]["pp"] * p["layout"]["cp"],
               "recompute": rc["recompute"], "recompute_layers": rc["recompute_layers"], "optimizer": rc["optimizer"],
               "peak_gib": round(p["peak_gib"], 2), "phase": p["peak_phase"], "fits": p["fits"],
               "refusal": p["refusal"], "items_gib": items}
        rows.append(row)
        print(f"{what:<52} {row['peak_gib']:>7.1f} GiB  {'fits' if row['fits'] else 'DOES NOT FIT'}"
              + (f"\n    {row['refusal']}" if row["refusal"] else ""), flush=True)
    build = cache_build_128k()
    print(f"cache build, {build['teacher']} at 131072 tokens: {build['total_gib']:.1f} GiB "
          f"({build['weights_gib']:.1f} weights + {build['forward_peak_gib']:.1f} forward)")
    with open(a.out, "w") as f:
        json.dump({"plans": rows, "cache_build_128k": build}, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
