"""Students from an FP8 teacher's cache against students from the bf16 teacher's cache, one call.

What a cache from a teacher run in FP8 does to the student trained from it, the only thing a user keeps of the
teacher pass. Stages, each `megatron-kd` itself in a fresh process:
  1. the teacher: 22 layers x 2048 (1.07 B) trained --teacher-iters steps with CE on real text (teacher_fp8.py's
     --trained teacher, so its distribution is peaked like a real teacher's);
  2. per --arms arm (teacher_fp8.py's names: bf16:te the reference, fp8:tensorwise, fp8:delayed:dpa, ...) a
     student trained with offline KD (top-100, forward KL) from a cache its own `megatron-kd train` builds first
     (kd.build_cache=true; the arm's teacher.* keys), all at one seed, the same samples and steps; the arms run side by
     side (--jobs) since the small teacher's pass leaves the GPU mostly idle;
  3. --seed2 N: the reference arm's student again at train.seed=N from the same cache (the spread two seeds give by
     themselves: the yardstick for the caches' difference) and the first FP8 arm's at N (a second pair);
  4. each FP8 cache against the bf16 one position by position (teacher_fp8.cache_fidelity), and `megatron-kd
     compare` of every student against the bf16 teacher on held-out samples (CE and full-vocabulary KL).
The check: each FP8 arm's student's held-out CE at the last evaluation within 0.5% of the bf16 arm's (--bar).

Corpus: teacher_fp8.py's docstring (stdlib + pydoc, BPE 8,192, made on the CPU by `megatron-kd data prepare`).

On the device: the Transformer Engine kit (../shared/te/README.md: five calls, then `source .whlte/device_install.sh`),
megatron-core, hydra-core, omegaconf and antlr4 wheels in .whl (pip install --target /tmp/site), and .kd_data carried;
--budget-s a little under the call's limit, so the students that finished and the JSON come back:
  source .whlte/device_install.sh && python3 benchmarks/fp8_cache_students.py --data .kd_data/text_document \
      --arms bf16:te fp8:tensorwise fp8:delayed:dpa --seed2 7 --budget-s 540 --out $OUT/fp8_cache_students_h200.json
CPU smoke (the plumbing: tiny models, two bf16 sdpa arms, no TE): python benchmarks/fp8_cache_students.py --smoke
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from teacher_fp8 import RECIPE, arm_overrides, cache_fidelity, tag, train_teacher  # noqa: E402

# a student a quarter of the teacher's depth and half its width: small enough that its steps cost little next to
# the cache builds, large enough to learn from a peaked teacher in a few hundred steps
STUDENT = ["num_layers=8", "hidden_size=1024", "num_attention_heads=16", "num_query_groups=4", "kv_channels=64",
           "ffn_hidden_size=2816", "tie_embeddings=false"]
SMOKE_STUDENT = ["num_layers=2", "hidden_size=64", "num_attention_heads=4", "num_query_groups=2", "kv_channels=16",
                 "ffn_hidden_size=128"]
# keys the arm sets (attention spec, FP8) or the teacher does not use for cache building
ARM_KEYS = {"attention_backend", "fp8", "fp8_recipe", "fp8_attention", "recompute_granularity", "recompute_method",
            "recompute_num_layers", "load", "hf_path"}


def teacher_overrides(save: str) -> list:
    """teacher.KEY=VALUE for every architecture key the CE run saved (the recipe's teacher is another model)."""
    import dataclasses
    from megatron_kd.checkpoint import store as ckpt
    from megatron_kd.recipe.schema import TeacherConfig
    saved = ckpt.read_common(save)["recipe"]["model"]
    known = {f.name for f in dataclasses.fields(TeacherConfig)} - ARM_KEYS
    out = []
    for k, v in sorted(saved.items()):
        if k not in known or isinstance(v, (dict, list)):
            continue
        text = "null" if v is None else ("true" if v is True else "false" if v is False else str(v))
        out.append(f"teacher.{k}={text}")
    return out + [f"teacher.load={save}"]


def student_command(a, name: str, arm: str, seed: int, build: bool, tover: list) -> tuple:
    save = os.path.join(a.work, name)
    cache = os.path.join(a.work, f"cache_{tag(arm)}")
    tok = os.path.join(os.path.dirname(a.data), "tokenizer.json")
    cmd = ["train", "--config-name", RECIPE, "data=pydoc", f"data.path={a.data}", f"data.tokenizer={tok}",
           f"data.seq_length={a.seq}", f"data.index_cache={os.path.join(a.work, 'index_' + name)}",
           f"kd.cache={cache}", f"kd.build_cache={'true' if build else 'false'}", "kd.top_k=100", "kd.log_ce=true",
           f"train.iters={a.student_iters}", f"train.global_batch_size={a.gbs}", f"train.micro_batch_size={a.gbs}",
           f"train.lr={a.lr:g}", f"train.min_lr={a.lr / 10:g}", "train.lr_warmup_iters=20", "train.optimizer=adam",
           f"train.eval_interval={a.eval_interval}", f"train.eval_iters={a.eval_iters}", "train.save_interval=null",
           "train.save_at_end=true", "train.log_interval=1", "train.progress=false", "train.tensorboard=false",
           f"train.seed={seed}", f"train.save={save}", f"hydra.run.dir={save}",
           "model.recompute_granularity=null", "model.recompute_method=null", "model.recompute_num_layers=null",
           *[f"model.{x}" for x in STUDENT], *tover, *arm_overrides(arm)]
    if a.smoke:  # CPU: tiny student, lean_adam (Megatron's Adam is CUDA-only)
        cmd += [f"model.{x}" for x in SMOKE_STUDENT] + ["train.device=cpu", "train.optimizer=lean_adam"]
    return cmd, save


def start(a, name, cmd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    log = open(os.path.join(a.work, f"{name}.log"), "w")
    print(f"[{name}] megatron-kd {' '.join(cmd)}", flush=True)
    return subprocess.Popen([sys.executable, "-m", "megatron_kd", *cmd], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT), log


def finish(a, name, save, proc, log, t0, deadline) -> dict:
    try:
        rc = proc.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
        rc = 124 if rc == 0 else rc
    log.close()
    text = open(os.path.join(a.work, f"{name}.log"), errors="replace").read()
    r = {"rc": rc, "wall_s": round(time.time() - t0, 1), "evals": [], "train": []}
    mp = os.path.join(save, "metrics.jsonl")
    if os.path.exists(mp):
        for line in open(mp):
            rec = json.loads(line)
            if rec.get("kind") == "eval":
                r["evals"].append({"iteration": rec["iteration"], "ce": rec.get("ce")})
            elif rec.get("kind") == "train":
                r["train"].append({k: rec.get(k) for k in ("iteration", "loss", "kl", "ce", "step_s")})
    sp = os.path.join(save, "summary.json")
    if os.path.exists(sp):
        s = json.load(open(sp))
        r["summary"] = {k: s.get(k) for k in ("loss", "kl", "ce", "eval", "step_s", "tflops_per_gpu", "peak_mem_gib")}
    r["cache_build"] = [ln for ln in text.splitlines() if "tokens/s" in ln and "cache" in ln.lower()][-2:]
    r["notes"] = [ln for ln in text.splitlines() if ln.startswith("note:")][:8]
    if rc:
        r["log_tail"] = text[-3000:]
    print(f"[{name}] rc={rc} in {r['wall_s']}s; held-out CE {[e['ce'] for e in r['evals']]}", flush=True)
    return r


def run_batch(a, jobs: list, tover, res, save_fn, deadline):
    """jobs: [(name, arm, seed, build)], run side by side, --jobs at a time."""
    pending = list(jobs)
    while pending:
        batch, pending = pending[:a.jobs], pending[a.jobs:]
        live = []
        for name, arm, seed, build in batch:
            if time.time() > deadline - 30:
                res["students"][name] = {"rc": None, "skipped": "out of time"}
                continue
            cmd, save = student_command(a, name, arm, seed, build, tover)
            proc, log = start(a, name, cmd)
            live.append((name, arm, seed, save, proc, log, time.time(), cmd))
        for name, arm, seed, save, proc, log, t0, cmd in live:
            r = finish(a, name, save, proc, log, t0, deadline)
            r.update(arm=arm, seed=seed, command="megatron-kd " + " ".join(cmd))
            res["students"][name] = r
            save_fn()


def verdict(res, ref_name, bar) -> dict:
    """Held-out CE of each student against the reference student, at every common evaluation."""
    S = res["students"]

    def ce(name):
        return {e["iteration"]: e["ce"] for e in (S.get(name) or {}).get("evals", []) if e["ce"] is not None}
    ref = ce(ref_name)
    out = {}
    for name in S:
        if name == ref_name:
            continue
        c = ce(name)
        steps = sorted(set(ref) & set(c))
        if not steps:
            continue
        rel = [(c[i] - ref[i]) / ref[i] for i in steps]
        out[name] = {"against": ref_name, "iterations": steps, "ce": [c[i] for i in steps],
                     "ce_ref": [ref[i] for i in steps], "rel_diff": rel, "final_rel_diff": rel[-1],
                     "max_abs_rel_diff": max(abs(x) for x in rel), "within_bar_at_last": abs(rel[-1]) <= bar}
    return out


def plot(res, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in res["students"].items():
        tl = [x["loss"] for x in r.get("train", []) if x.get("loss") is not None]
        w = 10
        sm = [sum(tl[max(0, i - w + 1):i + 1]) / len(tl[max(0, i - w + 1):i + 1]) for i in range(len(tl))]
        ax[0].plot(range(1, len(sm) + 1), sm, label=name)
        ev = [(e["iteration"], e["ce"]) for e in r.get("evals", []) if e["ce"] is not None]
        if ev:
            ax[1].plot(*zip(*ev), marker="o", label=name)
    ax[0].set(xlabel="step", ylabel="train loss (KD, mean of 10 steps)", title="students' training")
    v = res.get("verdict", {})
    title = "; ".join(f"{k.replace('student_', '')} {x['final_rel_diff']:+.2%}" for k, x in v.items())
    ax[1].set(xlabel="step", ylabel="held-out CE", title=f"held-out CE, last vs bf16: {title}"[:110])
    for x in ax:
        x.legend(fontsize=7)
        x.grid(alpha=0.3)
    fig.suptitle("students from bf16 and FP8 teacher caches (1.07 B teacher trained on real text)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", nargs="+", default=["bf16:te", "fp8:tensorwise"], help="the first is the reference")
    p.add_argument("--data", default=".kd_data/text_document")
    p.add_argument("--teacher-iters", type=int, default=300)
    p.add_argument("--student-iters", type=int, default=200)
    p.add_argument("--gbs", type=int, default=4, help="samples per student step (one micro-batch)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--eval-iters", type=int, default=6)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--seed", type=int, default=1234, help="the students' train.seed")
    p.add_argument("--seed2", type=int, default=None, help="the reference and the first FP8 arm again at this seed")
    p.add_argument("--jobs", type=int, default=4, help="students side by side on the one GPU")
    p.add_argument("--bar", type=float, default=0.005)
    p.add_argument("--budget-s", type=float, default=86400.0, help="start nothing after this many seconds")
    p.add_argument("--no-compare", action="store_true")
    p.add_argument("--work", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()
    t_start = time.time()
    deadline = t_start + a.budget_s
    if a.smoke:
        a.arms = ["bf16:sdpa", "bf16:sdpa:again"]
        a.teacher_iters, a.student_iters, a.seq, a.eval_interval, a.eval_iters = 6, 6, 128, 3, 1
        a.gbs, a.jobs, a.seed2 = 2, 2, 7 if a.seed2 is None else a.seed2
    from common import environment
    a.work = a.work or tempfile.mkdtemp(prefix="fp8_cache_students_")
    os.makedirs(a.work, exist_ok=True)
    res = {"benchmark": "students from FP8 vs bf16 teacher caches", "env": environment(), "args": vars(a),
           "students": {}}
    out = a.out or os.path.join(a.work, "result.json")

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    res["teacher_run"] = tr = train_teacher(a, timeout=max(10, deadline - time.time()))
    save()
    if tr["rc"]:
        print(json.dumps(tr, default=str)[:3000])
        return 2
    tover = teacher_overrides(tr["save"])
    res["teacher_overrides"] = tover
    names = {arm: f"student_{tag(arm)}" for arm in a.arms}
    run_batch(a, [(names[arm], arm, a.seed, True) for arm in a.arms], tover, res, save, deadline)
    if a.seed2 is not None:
        second = [(f"{names[a.arms[0]]}_seed{a.seed2}", a.arms[0], a.seed2, False)]
        if len(a.arms) > 1:
            second.append((f"{names[a.arms[1]]}_seed{a.seed2}", a.arms[1], a.seed2, False))
        run_batch(a, second, tover, res, save, deadline)
    res["verdict"] = verdict(res, names[a.arms[0]], a.bar)
    if a.seed2 is not None and len(a.arms) > 1:  # the second pair, both at seed2
        pair = verdict({"students": {k: v for k, v in res["students"].items() if k.endswith(f"_seed{a.seed2}")}},
                       f"{names[a.arms[0]]}_seed{a.seed2}", a.bar)
        res["verdict_seed2_pair"] = pair
    save()
    res["cache_fidelity"] = {}
    for arm in a.arms[1:]:
        try:
            res["cache_fidelity"][arm] = cache_fidelity(a.work, a.arms[0], arm)
        except Exception as e:  # a missing cache (its student failed) leaves the others' figures
            res["cache_fidelity"][arm] = {"error": f"{type(e).__name__}: {e}"[:500]}
        save()
    done = [r for r in res["students"].values() if r.get("rc") == 0]
    if not a.no_compare and done and time.time() < deadline - 60:
        cdir = os.path.join(a.work, "compare")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        runs = [os.path.join(a.work, n) for n, r in res["students"].items() if r.get("rc") == 0]
        t = time.time()
        pr = subprocess.run([sys.executable, "-m", "megatron_kd", "compare", *runs, "--teacher", tr["save"],
                             "--out", cdir], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=max(10, deadline - time.time()))
        cj = os.path.join(cdir, "compare.json")
        res["compare"] = {"rc": pr.returncode, "wall_s": round(time.time() - t, 1),
                          "table": open(os.path.join(cdir, "compare.md")).read() if pr.returncode == 0 else None,
                          "json": json.load(open(cj)) if os.path.exists(cj) else None,
                          "log_tail": None if pr.returncode == 0 else (pr.stdout + pr.stderr)[-3000:]}
        print(res["compare"]["table"] or res["compare"]["log_tail"], flush=True)
    res["wall_s"] = round(time.time() - t_start, 1)
    save()
    try:
        plot(res, os.path.splitext(out)[0] + ".png")
    except Exception as e:  # the figures are in the JSON; a plot failure must not lose them
        print(f"plot: {type(e).__name__}: {e}")
    print(json.dumps({"verdict": res.get("verdict"), "verdict_seed2_pair": res.get("verdict_seed2_pair"),
                      "cache_fidelity": {k: {x: v.get(x) for x in ("id_overlap_mean", "top1_agreement",
                                                                    "kl_shared_plus_rest_mean", "error")}
                                         for k, v in res["cache_fidelity"].items()}},
                     indent=1, default=str)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
