"""`megatron-kd train` under two trees of the package in one call: an earlier checkout (e.g. `git archive REV |
tar -x -C .old-REV`) and this one, the same recipe and overrides, one run after the other. Records per tree the
per-iteration losses, the median TFLOP/s and step time of the iterations after the first, the peak memory, the
cache build's tokens/s and wall time, and compares: losses equal, the teacher caches byte-identical (sha256 of
every file), TFLOP/s and peak ratios.

H200 (megatron-core + hydra carried as wheels in .whl, PYTHONPATH=/tmp/site):
  python benchmarks/tree_compare.py --old .old-2f66414 --out benchmarks/results/redesign_train_h200.json
CPU smoke (tiny_cpu): python benchmarks/tree_compare.py --old .old-2f66414 --smoke --out /tmp/tc.json
  --nproc 2 parallel.tp=2: the same under torchrun on two gloo ranks (a TP=2 cache build and training);
  --demo: `megatron-kd demo --small` under each tree instead, comparing its cache's bytes.
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GPU = ["--config-name", "llama31_8b_to_3b_32k_1xh200", "data.kind=mock", "data.path=null", "train.iters=4",
       "train.global_batch_size=4", "train.optimizer=lean_adam", "kd.build_cache=true", "train.eval_interval=null",
       "train.save_interval=1000", "train.save_at_end=false", "train.tensorboard=false", "train.progress=false",
       "data.num_workers=0"]
SMOKE = ["--config-name", "tiny_cpu", "data=mock", "data.vocab_size=256", "data.seq_length=64", "train.iters=4",
         "train.global_batch_size=4", "train.micro_batch_size=2", "kd.build_cache=true", "kd.top_k=8",
         "train.eval_interval=null", "train.tensorboard=false", "train.progress=false"]


def sha_tree(path: str) -> dict:
    out = {}
    for dirpath, _, files in os.walk(path):
        for f in sorted(files):
            p = os.path.join(dirpath, f)
            if f.endswith(".lock"):
                continue
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def run_tree(tree: str, name: str, args, work: str) -> dict:
    save, cache = os.path.join(work, f"run_{name}"), os.path.join(work, f"cache_{name}")
    if args.demo:  # one path for both: a dataset's identity includes its absolute path
        save = os.path.join(work, "run")
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
                                  "--master-port", str(29500 + os.getpid() % 1000)] if args.nproc > 1 else [])
    if args.demo:
        cmd = [*launch, "-m", "megatron_kd", "demo", "--small", "--no-progress", "--out", save]
        cache = os.path.join(save, "cache")
    else:
        cmd = [*launch, "-m", "megatron_kd", "train", *(SMOKE if args.smoke else GPU), f"train.save={save}",
               f"hydra.run.dir={save}", f"kd.cache={cache}", *args.overrides,
               *(args.new_overrides.split() if name == "new" and args.new_overrides else [])]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([os.path.abspath(tree), os.environ.get("PYTHONPATH", "")]))
    t0 = time.time()
    last_iter_s = None
    with open(os.path.join(work, f"{name}.log"), "w") as log:
        if args.until_iter:  # the wall time to the last iteration's line; the final checkpoint is not waited for
            p = subprocess.Popen(cmd, cwd=os.path.abspath(tree), env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
            pat = re.compile(rf"\biter(?:ation)?\s+{args.until_iter}\b")
            for line in p.stdout:
                log.write(line)
                if pat.search(line) and last_iter_s is None:
                    last_iter_s = time.time() - t0
                    time.sleep(2)  # metrics.jsonl is written with the line
                    os.killpg(p.pid, signal.SIGKILL)
                    break
            p.wait()
            rc = 0 if last_iter_s is not None else p.returncode
        else:
            rc = subprocess.run(cmd, cwd=os.path.abspath(tree), env=env, stdout=log,
                                stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    rec = {"tree": tree, "rc": rc, "wall_s": wall, "wall_to_last_iteration_s": last_iter_s, "cmd": " ".join(cmd[1:])}
    if rc != 0:
        rec["log_tail"] = open(os.path.join(work, f"{name}.log")).read()[-3000:]
        return rec
    if args.demo:
        rows = json.load(open(os.path.join(save, "results.json")))["rows"]
        os.rename(save, os.path.join(work, f"run_{name}"))
        save, cache = os.path.join(work, f"run_{name}"), os.path.join(work, f"run_{name}", "cache")
        rec.update(cache_sha=sha_tree(cache), results={k: {m: r.get(m) for m in ("ce", "kl")} for k, r in rows.items()})
        return rec
    train = {}
    for line in open(os.path.join(save, "metrics.jsonl")):
        r = json.loads(line)
        if r.get("kind") == "train":
            train[r["iteration"]] = r
    its = sorted(train)
    later = [train[i] for i in its[1:]] or [train[i] for i in its]
    summary_path = os.path.join(save, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    manifest = json.load(open(os.path.join(cache, "manifest.json")))
    rec.update(losses={i: train[i]["loss"] for i in its}, kl={i: train[i].get("kl") for i in its},
               tflops=statistics.median(r["tflops_per_gpu"] for r in later),
               step_s=statistics.median(r["step_s"] for r in later if r.get("step_s")) if any(
                   r.get("step_s") for r in later) else None,
               peak_gib=max(r["peak_mem_gib"] for r in train.values()), summary_peak_gib=summary.get("peak_mem_gib"),
               cache_sha=sha_tree(cache), cache_samples=manifest.get("num_samples"))
    shutil.rmtree(save, ignore_errors=True)  # a 3.2B checkpoint with optimizer state is tens of GB
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="a directory holding an earlier tree (megatron_kd/ and recipes/)")
    p.add_argument("--new", default=ROOT)
    p.add_argument("--smoke", action="store_true", help="tiny_cpu on CPU: checks the script, times mean nothing")
    p.add_argument("--nproc", type=int, default=1, help="ranks under torchrun (e.g. 2 with parallel.tp=2)")
    p.add_argument("--demo", action="store_true", help="compare `megatron-kd demo --small` caches (CPU)")
    p.add_argument("--work", default=None, help="scratch directory (default: a fresh one under /tmp)")
    p.add_argument("--new-overrides", default="",
                   help="overrides for the new tree only, e.g. keys the old tree does not know")
    p.add_argument("--until-iter", type=int, default=None,
                   help="stop each run once iteration N is printed (time to that line; no final checkpoint)")
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    work = args.work or f"/tmp/tree_compare_{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    from common import environment
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    old = run_tree(args.old, "old", args, work)
    with open(args.out, "w") as f:  # a run cut during the new tree keeps the old one
        json.dump({"old": old}, f, indent=1, default=str)
    print(json.dumps({"old_rc": old["rc"], "old_wall_s": old["wall_s"]}), flush=True)
    new = run_tree(args.new, "new", args, work)
    res = {"benchmark": "megatron-kd train, old tree vs new tree, same call", "env": environment(), "old": old,
           "new": new}
    if old["rc"] == 0 and new["rc"] == 0 and args.demo:
        res["checks"] = {"cache_byte_identical": old["cache_sha"] == new["cache_sha"],
                         "cache_files": len(new["cache_sha"]), "results_equal": old["results"] == new["results"]}
    elif old["rc"] == 0 and new["rc"] == 0:
        res["checks"] = {
            "losses_equal": old["losses"] == new["losses"],
            "max_loss_rel_diff": max(abs(old["losses"][i] - new["losses"][i]) / max(1e-30, abs(old["losses"][i]))
                                     for i in old["losses"]),
            "cache_byte_identical": old["cache_sha"] == new["cache_sha"],
            "tflops_new_over_old": new["tflops"] / old["tflops"],
            "peak_diff_gib": new["peak_gib"] - old["peak_gib"],
            "wall_new_over_old": new["wall_s"] / old["wall_s"]}
        if args.until_iter:
            res["checks"]["wall_to_last_iteration_new_over_old"] = (new["wall_to_last_iteration_s"]
                                                                   / old["wall_to_last_iteration_s"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps(res.get("checks", {"old_rc": old["rc"], "new_rc": new["rc"]}), indent=1))


if __name__ == "__main__":
    main()
