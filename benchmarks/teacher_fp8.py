"""The teacher pass in FP8 against bf16, one call: speed of the cache build and what FP8 does to the cache.

Arms (--arms, each a fresh process: TE keeps FP8 state per process), every one the same teacher weights (one seed)
over the same tokens:
  bf16:te            the teacher on Transformer Engine's layers in bf16 (the FP8 arms' spec, the baseline)
  bf16:sdpa          the teacher on the SDPA spec with the exact fusions (the bf16 path without TE)
  fp8:RECIPE[:dpa]   teacher.fp8=hybrid teacher.fp8_recipe=RECIPE (tensorwise, delayed, ...); dpa: TE's FP8
                     attention too (teacher.fp8_attention=true, delayed only)
Per arm: the bare forward and the output GEMM (the floor), build_cache of --samples samples (fp16 encoding) after a
one-sample warm build, tokens/s, peak memory, the cache's teacher identity; the hidden states of the first sample
(every --stride-th position) are kept for the fidelity.
Fidelity of each arm against the first (the reference), from the hidden states through the same output weight:
top-100 id overlap, top-1 agreement, KL(ref || arm) over the whole vocabulary and over the reference's top-100 ids
plus the tail (the distribution a loss with kd.tail=bucket sees); from the two caches themselves (every position of
every sample): id overlap and KL over the shared ids plus the rest (a lower bound of the full KL). The teacher's own
statistics (top-1 probability, entropy, top-100 mass) say how peaked it is: a random-weight teacher is nearly flat.

--trained: the same arms on a small teacher (22 layers x 2048, the te_stack FP8 student's shape) first trained
--teacher-iters steps with CE on real text (--data PREFIX, tokenizer.json beside it), over held-out windows of it.
The corpus of the H100 run, made on a CPU and carried: CPython's pydoc topics and its stdlib's top-level *.py files,
one JSON line each ({"text": ...}) in .kd_data/corpus.jsonl, then
  megatron-kd data prepare --input .kd_data/corpus.jsonl --output-prefix .kd_data/text_document --vocab-size 8192
  cp .kd_data/text_document.tokenizer.json .kd_data/tokenizer.json

  source .whlte/device_install.sh && python3 benchmarks/teacher_fp8.py --arms bf16:te fp8:tensorwise \
      --samples 8 --out $OUT/teacher_fp8_h100.json
CPU smoke (the script's plumbing; no TE, so bf16:sdpa arms only): python benchmarks/teacher_fp8.py --smoke
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RECIPE = "llama31_8b_to_3b_32k_1xh200"
SMOKE = ["data=mock", "data.vocab_size=4096", "data.seq_length=256", "train.device=cpu", "teacher.num_layers=2",
         "teacher.hidden_size=256", "teacher.ffn_hidden_size=512", "teacher.num_attention_heads=4",
         "teacher.num_query_groups=2", "teacher.kv_channels=64"]
TRAINED = ["num_layers=22", "hidden_size=2048", "num_attention_heads=16", "num_query_groups=8", "kv_channels=128",
           "ffn_hidden_size=5632", "tie_embeddings=false"]


def arm_overrides(arm: str) -> list:
    prec, what, *more = arm.split(":")
    if prec == "bf16":
        return [f"teacher.attention_backend={what}"]
    return ["teacher.attention_backend=te", "teacher.fp8=hybrid", f"teacher.fp8_recipe={what}"] + (
        ["teacher.fp8_attention=true"] if "dpa" in more else [])


def heldout_tokens(prefix: str, n: int, seq: int):
    """n windows of seq + 1 tokens from the last 5% of the corpus's documents (the split's held-out part)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    ds = IndexedDataset(prefix)
    first = int(len(ds) * 0.95)
    toks = np.concatenate([np.asarray(ds[i], dtype=np.int64) for i in range(first, len(ds))])
    if toks.size < n * (seq + 1):
        raise SystemExit(f"{prefix}: {toks.size} held-out tokens, fewer than {n} x {seq + 1}")
    return toks[: n * (seq + 1)].reshape(n, seq + 1)


def trained_teacher(a, over):
    """The teacher saved by --trained's CE run, with the arm's FP8 keys (the saved model section otherwise)."""
    import dataclasses
    from megatron_kd.checkpoint import store as ckpt
    from megatron_kd.recipe.schema import DataConfig, ParallelConfig, Recipe, TeacherConfig, TrainConfig
    from megatron_kd.teacher.megatron import start_cache_teacher
    saved = ckpt.read_common(a.teacher_load)["recipe"]["model"]
    known = {f.name for f in dataclasses.fields(TeacherConfig)}
    t = TeacherConfig(**{k: v for k, v in saved.items() if k in known})
    for o in over:
        k, v = o.split("=", 1)
        k = k.split(".", 1)[1]
        setattr(t, k, {"true": True, "false": False}.get(v, v))
    t.load, t.hf_path = a.teacher_load, None
    r = Recipe(teacher=t, parallel=ParallelConfig(), data=DataConfig(seq_length=a.seq),
               train=TrainConfig(precision="bf16", device="auto"))
    return start_cache_teacher(r, a.vocab), t


def child(a) -> dict:
    import numpy as np
    import torch
    from teacher_pass import measure_floor
    from megatron_kd.cache.encoding import EncodingOptions
    from megatron_kd.teacher.build import build_cache

    cuda = torch.cuda.is_available()
    over = arm_overrides(a.arm)
    t0 = time.perf_counter()
    if a.teacher_load:
        teacher, _ = trained_teacher(a, over)
        vocab, seq = a.vocab, a.seq
        data = torch.from_numpy(heldout_tokens(a.data, a.samples, seq))
    else:
        from megatron_kd.recipe.compose import compose
        from megatron_kd.recipe.schema import to_recipe
        from megatron_kd.teacher.megatron import start_cache_teacher
        base = SMOKE if a.smoke else []
        r = to_recipe(compose(RECIPE, base + over + ["kd.cache=/dev/null"], save="/dev/null"))
        vocab, seq = r.data.vocab_size, r.data.seq_length
        teacher = start_cache_teacher(r, vocab)
        g = np.random.default_rng(0)
        data = torch.from_numpy(g.integers(0, vocab, size=(a.samples, seq + 1)))
    if cuda:
        torch.cuda.synchronize()
    res = {"arm": a.arm, "overrides": over, "seq_length": seq, "vocab_size": vocab,
           "teacher_init_s": time.perf_counter() - t0, "identity": teacher.identity()}
    out, hidden, floor = measure_floor(teacher, data[0, :seq][None], a.reps)
    res.update(floor)
    os.makedirs(a.work, exist_ok=True)
    torch.save(hidden[::a.stride].cpu().clone(), os.path.join(a.work, f"hidden_{tag(a.arm)}.pt"))
    wpath = os.path.join(a.work, "weight.pt")
    if not os.path.exists(wpath):
        torch.save(out.weight.detach().cpu().clone(), wpath)
    res["weight_sum"] = float(out.weight.float().sum())  # the same weights in every arm (one seed)
    del out, hidden
    if cuda:
        torch.cuda.empty_cache()

    def build(path, n):
        return build_cache(teacher, data, os.path.join(a.work, path), encoding=EncodingOptions("fp16", a.top_k),
                           num_samples=n, progress=False, samples_per_shard=max(1, n // 2))

    build(f"warm_{tag(a.arm)}", 1)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    t = time.perf_counter()
    m = build(f"cache_{tag(a.arm)}", a.samples)
    wall = time.perf_counter() - t
    res["build"] = {"samples": a.samples, "wall_s": wall, "s_per_sample": wall / a.samples,
                    "tokens_per_s": a.samples * seq / wall, "over_floor": wall / a.samples / res["floor_s"],
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                    "manifest_teacher": m["teacher"]}
    return res


def tag(arm: str) -> str:
    return arm.replace(":", "_")


def exact_fidelity(work, ref, arm, vocab, k, chunk=512) -> dict:
    """Against the reference arm's hidden states, through the one output weight: full-vocabulary and top-K views."""
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.load(os.path.join(work, "weight.pt")).to(dev)
    ha = torch.load(os.path.join(work, f"hidden_{tag(ref)}.pt")).to(dev)
    hb = torch.load(os.path.join(work, f"hidden_{tag(arm)}.pt")).to(dev)
    acc = {x: [] for x in ("kl_full", "kl_topk_tail", "overlap", "top1", "p1_ref", "entropy_ref", "mass_ref",
                           "hidden_rel_err")}
    for i in range(0, ha.shape[0], chunk):
        a_, b_ = ha[i:i + chunk], hb[i:i + chunk]
        acc["hidden_rel_err"].append(((a_.float() - b_.float()).norm(dim=-1) / a_.float().norm(dim=-1)).cpu())
        la = torch.log_softmax((a_ @ w.t())[:, :vocab].float(), -1)
        lb = torch.log_softmax((b_ @ w.t())[:, :vocab].float(), -1)
        pa = la.exp()
        acc["kl_full"].append((pa * (la - lb)).sum(-1).cpu())
        ta, tb = la.topk(k, -1), lb.topk(k, -1)
        acc["overlap"].append(((ta.indices[:, :, None] == tb.indices[:, None, :]).any(-1).float().mean(-1)).cpu())
        acc["top1"].append((ta.indices[:, 0] == tb.indices[:, 0]).float().cpu())
        p, lq = ta.values.exp(), lb.gather(1, ta.indices)
        pt, qt = (1 - p.sum(-1)).clamp_min(1e-12), (1 - lq.exp().sum(-1)).clamp_min(1e-12)
        acc["kl_topk_tail"].append(((p * (ta.values - lq)).sum(-1) + pt * (pt.log() - qt.log())).cpu())
        acc["p1_ref"].append(p[:, 0].cpu())
        acc["entropy_ref"].append(-(pa * la).sum(-1).cpu())
        acc["mass_ref"].append(p.sum(-1).cpu())
    out = {"positions": int(ha.shape[0])}
    for x, v in acc.items():
        t = torch.cat(v).double()
        out[x] = {"mean": float(t.mean()), "p99": float(t.quantile(0.99)) if t.numel() > 1 else float(t[0]),
                  "max": float(t.max()), "min": float(t.min())}
    return out


def cache_fidelity(work, ref, arm, chunk=2048) -> dict:
    """The two caches position by position: id overlap, top-1 agreement, |log-prob difference| on shared ids, and
    KL over the shared ids plus one bucket for the rest (each cache's own tail mass folded in: a lower bound of the
    full KL, computable from the caches alone)."""
    import torch
    from megatron_kd.cache.reader import CacheReader
    ra, rb = CacheReader(os.path.join(work, f"cache_{tag(ref)}")), CacheReader(os.path.join(work, f"cache_{tag(arm)}"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ov, t1, kl, dlp = [], [], [], []
    for i in range(min(len(ra), len(rb))):
        x, y = ra.read(i), rb.read(i)
        for j in range(0, x["topk_ids"].shape[0], chunk):
            ia = torch.as_tensor(x["topk_ids"][j:j + chunk]).to(dev).long()
            ib = torch.as_tensor(y["topk_ids"][j:j + chunk]).to(dev).long()
            la = torch.as_tensor(x["topk_logprobs"][j:j + chunk]).to(dev).double()
            lb = torch.as_tensor(y["topk_logprobs"][j:j + chunk]).to(dev).double()
            eq = ia[:, :, None] == ib[:, None, :]
            common = eq.any(2)
            lq = torch.where(common, (eq * lb[:, None, :]).sum(2), torch.zeros_like(la))
            pc = torch.where(common, la.exp(), torch.zeros_like(la))
            qc = torch.where(common, lq.exp(), torch.zeros_like(la))
            pr, qr = (1 - pc.sum(-1)).clamp_min(1e-12), (1 - qc.sum(-1)).clamp_min(1e-12)
            kl.append(((pc * (la - lq)).sum(-1) + pr * (pr.log() - qr.log())).cpu())
            ov.append(common.double().mean(-1).cpu())
            t1.append((ia[:, 0] == ib[:, 0]).double().cpu())
            dlp.append((la - lq).abs()[common].cpu())
    ov, t1, kl, dlp = (torch.cat(v) for v in (ov, t1, kl, dlp))
    return {"positions": int(ov.numel()), "id_overlap_mean": float(ov.mean()), "id_overlap_min": float(ov.min()),
            "top1_agreement": float(t1.mean()), "kl_shared_plus_rest_mean": float(kl.mean()),
            "kl_shared_plus_rest_p99": float(kl.quantile(0.99)) if kl.numel() > 1 else float(kl[0]),
            "logprob_absdiff_mean": float(dlp.mean()), "logprob_absdiff_max": float(dlp.max()),
            "teacher_ref": ra.manifest["teacher"], "teacher_arm": rb.manifest["teacher"]}


def run_arm(a, arm, extra) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--arm", arm, "--work", a.work,
            "--samples", str(a.samples), "--reps", str(a.reps), "--stride", str(a.stride), "--top-k", str(a.top_k),
            *extra, *(["--smoke"] if a.smoke else [])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    t = time.time()
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    print(f"[{arm}] rc={p.returncode} in {time.time() - t:.0f}s", flush=True)
    if p.returncode:
        return {"arm": arm, "rc": p.returncode, "log_tail": (p.stdout + p.stderr)[-4000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def compare(a, runs, vocab) -> dict:
    ok = [r for r in runs if "build" in r]
    if len(ok) < 2:
        return {}
    ref = ok[0]
    out = {}
    for r in ok[1:]:
        out[r["arm"]] = {
            "tokens_per_s_over_ref": r["build"]["tokens_per_s"] / ref["build"]["tokens_per_s"],
            "forward_over_ref": ref["forward_s"] / r["forward_s"],
            "same_weights": r["weight_sum"] == ref["weight_sum"],
            "exact": exact_fidelity(a.work, ref["arm"], r["arm"], vocab, a.top_k),
            "cache": cache_fidelity(a.work, ref["arm"], r["arm"])}
        print(f"[{r['arm']} vs {ref['arm']}] " + json.dumps({k: v for k, v in out[r["arm"]].items()
                                                            if k != "cache"}, default=str)[:1500], flush=True)
    return {"reference": ref["arm"], "arms": out}


def train_teacher(a, timeout=None) -> dict:
    """A small teacher trained with CE on real text (`megatron-kd train`), saved at the end; rc 124 when it outruns
    `timeout` seconds (a caller with a device budget keeps what it has instead of losing the whole call)."""
    tok = os.path.join(os.path.dirname(a.data), "tokenizer.json")
    save = os.path.join(a.work, "teacher_run")
    cmd = [sys.executable, "-m", "megatron_kd", "train", "--config-name", RECIPE, "kd=ce", "data=pydoc",
           f"data.path={a.data}", f"data.tokenizer={tok}", f"data.seq_length={a.seq}",
           f"train.iters={a.teacher_iters}", "train.global_batch_size=8", "train.micro_batch_size=4",
           "train.lr=3e-4", "train.min_lr=3e-5", "train.lr_warmup_iters=20", "train.optimizer=adam",
           f"train.eval_interval={a.teacher_iters}", "train.eval_iters=4", "train.save_interval=null",
           "train.save_at_end=true", "train.log_interval=25", "train.progress=false", "train.tensorboard=false",
           f"train.save={save}", f"hydra.run.dir={save}", "model.recompute_granularity=null",
           "model.recompute_method=null", "model.recompute_num_layers=null", *[f"model.{x}" for x in TRAINED]]
    if a.smoke:  # a CPU check of the plumbing: a tiny teacher, lean_adam (Megatron's Adam is CUDA-only)
        cmd += ["model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=256",
                "model.num_attention_heads=4", "model.num_query_groups=2", "model.kv_channels=32",
                "train.device=cpu", "train.optimizer=lean_adam", "train.global_batch_size=2",
                "train.micro_batch_size=1"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    t = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        p = subprocess.CompletedProcess(cmd, 124, out.decode(errors="replace") if isinstance(out, bytes) else out, "")
    text = p.stdout + p.stderr
    print(f"[teacher CE run] rc={p.returncode} in {time.time() - t:.0f}s", flush=True)
    evals = []
    mp = os.path.join(save, "metrics.jsonl")
    if os.path.exists(mp):
        evals = [json.loads(ln) for ln in open(mp) if '"eval"' in ln or '"valid"' in ln]
    res = {"rc": p.returncode, "wall_s": time.time() - t, "evals": evals, "save": save,
           "summary": json.load(open(os.path.join(save, "summary.json"))) if os.path.exists(
               os.path.join(save, "summary.json")) else None}
    if p.returncode:
        res["log_tail"] = text[-3000:]
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", nargs="+", default=["bf16:te", "fp8:tensorwise"])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--stride", type=int, default=8, help="keep every Nth position's hidden state for the fidelity")
    p.add_argument("--top-k", type=int, default=100)
    p.add_argument("--trained", action="store_true", help="also the arms on a small teacher trained on --data")
    p.add_argument("--trained-arms", nargs="+", default=None, help="default: --arms")
    p.add_argument("--data", default=".kd_data/text_document")
    p.add_argument("--teacher-iters", type=int, default=300)
    p.add_argument("--seq", type=int, default=2048, help="--trained: tokens per sample")
    p.add_argument("--skip-8b", action="store_true", help="only the --trained part")
    p.add_argument("--work", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    # child-only
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--teacher-load", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a), default=str))
        return 0
    from common import environment
    a.work = a.work or tempfile.mkdtemp(prefix="teacher_fp8_")
    res = {"benchmark": "teacher pass, FP8 vs bf16", "env": environment(), "args": vars(a)}

    def save():
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1, default=str)
    root_work = a.work
    if not a.skip_8b:
        a.work = os.path.join(root_work, "8b")
        runs = [run_arm(a, arm, []) for arm in a.arms]
        res["runs_8b"] = runs
        save()
        vocab = next((r["vocab_size"] for r in runs if "vocab_size" in r), None)
        res["compare_8b"] = compare(a, runs, vocab) if vocab else {}
        save()
    if a.trained:
        a.work = os.path.join(root_work, "trained")
        os.makedirs(a.work, exist_ok=True)
        res["teacher_run"] = tr = train_teacher(a)
        save()
        if tr["rc"] == 0:
            from megatron_kd.data.datasets import FileTokenizer
            vocab = FileTokenizer(os.path.join(os.path.dirname(a.data), "tokenizer.json")).vocab_size
            extra = ["--teacher-load", tr["save"], "--vocab", str(vocab), "--data", a.data, "--seq", str(a.seq)]
            runs = [run_arm(a, arm, extra) for arm in (a.trained_arms or a.arms)]
            res["runs_trained"] = runs
            save()
            res["compare_trained"] = compare(a, runs, vocab)
            save()
    save()
    brief = {k: v for k, v in res.items() if k.startswith("compare")}
    for key in ("runs_8b", "runs_trained"):
        brief[key] = [{x: r.get(x) for x in ("arm", "rc", "forward_s", "output_gemm_s", "floor_s", "log_tail")}
                      | {"build": {x: (r.get("build") or {}).get(x) for x in ("tokens_per_s", "over_floor", "peak_gib")}}
                      for r in res.get(key, [])]
    print(json.dumps(brief, indent=1, default=str)[:8000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
