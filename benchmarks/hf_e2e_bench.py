"""The HF user path at Llama-3.1-8B (teacher) -> Llama-3.2-3B (student) shapes on one GPU,
beside the random-init figures of the same recipe in the same call.

Makes random HF checkpoints of both shapes (bf16, transformers' save_pretrained) from the recipe's own model
sections, then for each arm (`random`: the recipe as is; `hf`: teacher.hf_path + model.hf_path):
cache build (teacher load seconds, build tokens/s), offline training (median step TFLOP/s, tokens/s, peak
memory), and for the hf arm the export time of the trained student (transformers then loads it). JSON to
$OUT/hf_e2e_bench.json (or --out). Device call (see the issue-16 report):

    pip install -q --no-index --no-deps --target /tmp/site .whl-bridge/*.whl && \\
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/hf_e2e_bench.py --shapes real --out $OUT/hf_e2e_bench.json

CPU smoke test (tiny shapes, Python 3.12 venv with Bridge): python benchmarks/hf_e2e_bench.py --shapes tiny
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "bridge_env"))  # TEST-ONLY shims: machines without TE (the device)
if "tiny" in sys.argv:  # CPU smoke test: megatron jit_fuser = torch.compile is slow on tiny models
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
import shims  # noqa: E402,F401
import torch  # noqa: E402

RECIPE = "llama31_8b_to_3b_32k_1xh200"
TINY = {"layers": 2, "hidden": 64, "ffn": 128, "heads": 4, "groups": 2, "kv": 16}


def shape_overrides(shapes: str, vocab: int, seq: int, iters: int, gbs: int) -> list:
    ov = ["data=mock", f"data.vocab_size={vocab}", f"data.seq_length={seq}", f"train.iters={iters}",
          "train.micro_batch_size=1", f"train.global_batch_size={gbs}", "train.eval_iters=1",
          "train.eval_interval=null", "train.save_interval=null", "train.progress=false", "train.tensorboard=false",
          "train.log_interval=1", "kd.top_k=100" if shapes == "real" else "kd.top_k=8"]
    if shapes == "real":
        return ov + ["train.optimizer=lean_adam", "train.precision=bf16"]
    t = TINY
    for sec in ("model", "teacher"):
        ov += [f"{sec}.num_layers={t['layers']}", f"{sec}.hidden_size={t['hidden']}",
               f"{sec}.ffn_hidden_size={t['ffn']}", f"{sec}.num_attention_heads={t['heads']}",
               f"{sec}.num_query_groups={t['groups']}", f"{sec}.kv_channels={t['kv']}",
               f"{sec}.recompute_granularity=null", f"{sec}.recompute_method=null",
               f"{sec}.recompute_num_layers=null"]
    return ov + ["train.precision=fp32", "train.device=cpu", "kd.chunk_size=null"]


def make_hf_like(m, vocab: int, out: str, dtype) -> float:
    """A random HF Llama checkpoint with the architecture of recipe section m; returns seconds."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    t0 = time.perf_counter()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                      num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                      num_key_value_heads=m.num_query_groups or m.num_attention_heads, head_dim=m.kv_channels,
                      rms_norm_eps=m.layernorm_epsilon, tie_word_embeddings=m.tie_embeddings,
                      rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
                      max_position_embeddings=131072, dtype=str(dtype).replace("torch.", ""))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(out)
    del model
    sys.path.insert(0, os.path.join(ROOT, "tests", "hf"))
    from tiny import tokenizer_files  # a WordLevel tokenizer of `vocab` ids (no network for Llama's own)
    tokenizer_files(out, vocab)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def recipe(overrides, save):
    from megatron_kd.recipe.schema import to_recipe
    from megatron_kd.recipe.compose import compose
    return to_recipe(compose(RECIPE, overrides, save=save))


def cache_arm(ov, cache) -> dict:
    """Teacher load and cache build, timed apart (the build's tokens/s is the teacher's forward + top-K)."""
    from megatron.core import parallel_state as ps
    from megatron_kd.cache.encoding import EncodingOptions
    from megatron_kd.teacher.build import build_cache
    from megatron_kd.data.datasets import samples_needed
    from megatron_kd.teacher.factories import recipe_dataset, recipe_teacher
    r = recipe(ov, os.path.dirname(cache))
    n = samples_needed(r.train, r.data)[0]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    teacher = recipe_teacher(RECIPE, ov) if r.teacher.hf_path else random_teacher(r)
    load_s = time.perf_counter() - t0
    ds = recipe_dataset(RECIPE, ov)
    warm = torch.stack([torch.as_tensor(ds[0]["tokens"])])
    teacher(warm)  # kernels / allocator warm before the timed build
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    build_cache(teacher, ds, cache, encoding=EncodingOptions(top_k=r.kd.top_k), num_samples=n, micro_batch_size=1,
                progress=False, tokenizer_id="", dataset_id="bench", tp_group=ps.get_tensor_model_parallel_group())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t1
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    del teacher
    ps.destroy_model_parallel()
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"teacher_load_s": load_s, "build_s": build_s, "samples": n,
            "build_tokens_per_s": n * r.data.seq_length / build_s, "peak_mem_gib": peak}


def random_teacher(r):
    """recipe_teacher's teacher with random weights (no teacher.load): the random-init arm."""
    from megatron.core import parallel_state as ps
    from megatron_kd.teacher.megatron import MegatronTeacher
    from megatron_kd.runtime.dist import init_model_parallel, init_process_group, set_seed, use_cuda
    from megatron_kd.models.builder import build_gpt
    from megatron_kd.teacher.megatron import freeze
    cuda = use_cuda(r.train.device)
    init_process_group(cuda)
    init_model_parallel(r.parallel, cuda)
    set_seed(r.train.seed)
    m = build_gpt(r.teacher, r.parallel, r.data.vocab_size, r.data.seq_length, r.train.precision)
    freeze(m)
    return MegatronTeacher(m, r.data.vocab_size, name=r.teacher.name, tp_group=ps.get_tensor_model_parallel_group())


def train_arm(ov, save) -> dict:
    from megatron_kd.training.loop import run
    r = recipe(ov, save)
    start = None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated() / 2**30  # what an earlier arm left allocated (should be ~0)
    t0 = time.perf_counter()
    s = run(r, save)
    return {"wall_s": time.perf_counter() - t0, "allocated_at_start_gib": start, **{k: s.get(k) for k in
            ("step_s", "tokens_per_s", "tflops_per_gpu", "peak_mem_gib", "loss")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", choices=("real", "tiny"), default="real")
    ap.add_argument("--seq", type=int, default=None, help="default 32768 (real), 64 (tiny)")
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=2)
    ap.add_argument("--workdir", default=None, help="scratch for checkpoints (default: a temp dir, deleted)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", os.path.join(ROOT, "benchmarks", "results")),
                                                  "hf_e2e_bench.json"))
    a = ap.parse_args(argv)
    from megatron_kd.runtime.quiet import quiet_megatron_warnings
    quiet_megatron_warnings()
    real = a.shapes == "real"
    vocab, seq = (128256, a.seq or 32768) if real else (256, a.seq or 64)
    work = a.workdir or tempfile.mkdtemp(prefix="hf_e2e_")
    ov = shape_overrides(a.shapes, vocab, seq, a.iters, a.global_batch_size)
    res = {"recipe": RECIPE, "shapes": a.shapes, "seq_length": seq, "iters": a.iters,
           "global_batch_size": a.global_batch_size, "device": torch.cuda.get_device_name() if
           torch.cuda.is_available() else "cpu", "overrides": ov}
    base = recipe(ov, os.path.join(work, "x"))
    dtype = torch.bfloat16 if real else torch.float32
    teacher_hf, student_hf = os.path.join(work, "teacher_hf"), os.path.join(work, "student_hf")
    res["make_hf_s"] = {"teacher": make_hf_like(base.teacher, vocab, teacher_hf, dtype),
                        "student": make_hf_like(base.model, vocab, student_hf, dtype)}
    hf_ov = [f"teacher.hf_path={teacher_hf}", f"model.hf_path={student_hf}"]
    arms = {"random": ov, "hf": ov + hf_ov}
    # cache builds in the order random, hf, hf, random (ABBA: GPU clocks and allocator warm-up drift cancels);
    # tokens/s is the mean of each arm's two builds, the caches of the second builds are the ones trained on
    builds = {name: [] for name in arms}
    for i, name in enumerate(("random", "hf", "hf", "random")):
        tag = f"{name}{i}"
        b = cache_arm(arms[name] + [f"kd.cache={work}/cache_{tag}"], f"{work}/cache_{tag}")
        builds[name].append(b)
        print(name, "cache", b, flush=True)
        final = f"{work}/cache_{name}"
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(f"{work}/cache_{tag}", final)
    for name, bs in builds.items():
        res[f"cache_{name}"] = {**bs[-1], "builds": bs,
                                "build_tokens_per_s": sum(b["build_tokens_per_s"] for b in bs) / len(bs)}
    shutil.rmtree(teacher_hf)  # disk: the 8B teacher (16 GB) is no longer needed
    for name, o in arms.items():
        save = os.path.join(work, f"run_{name}")
        res[f"train_{name}"] = train_arm(o + [f"kd.cache={work}/cache_{name}", "kd.build_cache=false"], save)
        print(name, "train", res[f"train_{name}"], flush=True)
        if name == "hf":
            from megatron_kd.export.to_hf import export
            out = os.path.join(work, "student_kd_hf")
            e = export(save, out)
            t0 = time.perf_counter()
            from transformers import AutoModelForCausalLM
            AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
            res["export"] = {"seconds": e["seconds"], "transformers_load_s": time.perf_counter() - t0,
                             "files": e["files"]}
            print("export", res["export"], flush=True)
        shutil.rmtree(save)
    rel = {}
    for k_arm, k in (("cache", "build_tokens_per_s"), ("train", "tflops_per_gpu"), ("train", "peak_mem_gib")):
        x, y = res[f"{k_arm}_random"][k], res[f"{k_arm}_hf"][k]
        rel[f"{k_arm}.{k}"] = None if not x or y is None else y / x - 1
    res["hf_vs_random"] = rel
    res["within_2pct"] = all(v is not None and abs(v) <= 0.02 for v in rel.values())
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps({"hf_vs_random": rel, "within_2pct": res["within_2pct"], "export": res.get("export")}, indent=1))
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
