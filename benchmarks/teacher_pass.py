"""The teacher pass against its floor, one or more trees of the package in one call.

Per tree (a fresh subprocess with PYTHONPATH = that tree), on the recipe's teacher (random weights, mock tokens):
  floor     the teacher's bare forward (output layer bypassed: what MegatronTeacher returns) and the output GEMM
            alone (hidden @ W^T over the same row chunks the top-K uses); their sum is the floor of a cache build;
  topk      the tree's topk_from_hidden on those hidden states (output GEMM included);
  build     build_cache end to end (the function both `megatron-kd cache build` and `train kd.build_cache=true`
            run) over --samples samples per encoding, tokens/s, and the sha256 of every shard it wrote;
  profile   (--profile) torch.profiler over a build of --profile-samples samples: GPU time by kind of kernel,
            GPU busy time against wall time (idle gaps), device-to-host copies, host syncs, and the wall time
            the host spent encoding and writing;
  hf        (--hf) transformers' LlamaModel of the same shape (bf16, SDPA): forward without the output layer.

H200 (carry .whl-bridge; PYTHONPATH=/tmp/site holds megatron-core):
  python benchmarks/teacher_pass.py --trees .old-REV . --profile --hf --out benchmarks/results/teacher_pass_h200.json
  python benchmarks/teacher_pass.py --trees .old-REV . --shape gpt-oss --layers 8 --out ...
  with TE importable (source .whlte/device_install.sh), TE's grouped experts:
  python benchmarks/teacher_pass.py --shape gpt-oss --layers 6 --samples 8 --override teacher.moe_grouped_gemm=true ...
CPU smoke (checks the script; times mean nothing): python benchmarks/teacher_pass.py --smoke --trees . --profile
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {  # recipe, overrides of its teacher
    "llama8b": ("llama31_8b_to_3b_32k_1xh200", []),
    "gpt-oss": ("gpt_oss_20b_32k_8xh200", ["parallel=single", "model.moe_grouped_gemm=false",
                                           "teacher.moe_grouped_gemm=false"]),  # the teacher alone on one GPU
    "smoke": ("tiny_cpu", ["data=mock", "data.vocab_size=4096", "data.seq_length=256", "train.device=cpu"]),
}

# GPU kernels by kind, first match wins (names as CUDA / Triton report them)
KINDS = [("attention", ("flash", "fmha", "attention", "flex", "triton_tem_fused")),
         ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "sm90", "sm80", "cublas")),
         ("topk/sort", ("topk", "radix", "sort", "gathertopk", "select")),
         ("reduce", ("reduce",)),
         ("copy", ("copy", "memcpy", "memset", "cat")),
         ("elementwise", ("elementwise", "vectorized", "unrolled", "triton"))]


def child(a) -> dict:
    import hashlib
    import time

    import numpy as np
    import torch

    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import to_recipe
    from megatron_kd.teacher import build as build_mod
    from megatron_kd.cache.encoding import EncodingOptions
    from megatron_kd.teacher.build import build_cache
    from megatron_kd.teacher.megatron import start_cache_teacher
    from megatron_kd.parallel.topk import topk_from_hidden

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    name, over = SHAPES[a.shape]
    over = list(over) + ([f"teacher.num_layers={a.layers}"] if a.layers else []) + [f"data.seq_length={a.seq}"] * bool(a.seq)
    over += a.override
    import dataclasses
    from megatron_kd.recipe.schema import TeacherConfig
    if a.plain_rope and "rope_scaling" in {f.name for f in dataclasses.fields(TeacherConfig)}:
        over.append("teacher.rope_scaling=false")  # the architecture of a tree whose presets predate the scaling
    r = to_recipe(compose(name, over + ["kd.cache=/dev/null"], save="/dev/null"))
    vocab, seq, k = r.data.vocab_size, r.data.seq_length, a.top_k
    res = {"recipe": name, "overrides": over, "seq_length": seq, "vocab_size": vocab, "top_k": k,
           "teacher_layers": r.teacher.num_layers, "hidden": r.teacher.hidden_size}
    t0 = time.perf_counter()
    teacher = start_cache_teacher(r, vocab)
    sync()
    res["teacher_init_s"] = time.perf_counter() - t0
    g = np.random.default_rng(0)
    data = torch.from_numpy(g.integers(0, vocab, size=(max(a.samples, a.more_samples or 0) + 1, seq + 1)))

    tokens = data[0, :seq][None]
    out, hidden, floor = measure_floor(teacher, tokens, a.reps, a.chunk_size)
    res.update(floor)
    timed = median_time
    res["topk_s"] = timed(lambda: topk_from_hidden(hidden, out.weight, k, None, a.chunk_size, 1.0, None, vocab),
                          a.reps)
    del out, hidden
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    ident = {"name": "bench", "config_hash": "0", "weights_hash": "0"}
    work = tempfile.mkdtemp(prefix="teacher_pass_")

    def build(path, n, enc):
        return build_cache(teacher, data, os.path.join(work, path), encoding=EncodingOptions(enc, k), num_samples=n,
                           samples_per_shard=max(1, a.samples // 2), progress=False, dataset_id="bench",
                           teacher_id=ident, micro_batch_size=a.micro_batch_size, chunk_size=a.chunk_size)

    build("warm", 1, "fp16")
    res["build"] = {}
    for enc in a.encodings.split(","):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        build(enc, a.samples, enc)
        wall = time.perf_counter() - t
        shards = os.path.join(work, enc, "shards")
        sha = {f: hashlib.sha256(open(os.path.join(shards, f), "rb").read()).hexdigest()
               for f in sorted(os.listdir(shards)) if f.endswith(".bin")}
        res["build"][enc] = {"samples": a.samples, "wall_s": wall, "s_per_sample": wall / a.samples,
                             "tokens_per_s": a.samples * seq / wall, "over_floor": wall / a.samples / res["floor_s"],
                             "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                             "shard_sha256": sha}
    if a.more_samples:  # a second build of more samples: its extra wall time over the extra samples is the steady
        # per-sample cost, free of what a build pays once (setup, pipeline fill and drain, the shards' finalize)
        enc = a.encodings.split(",")[0]
        t = time.perf_counter()
        build("more", a.more_samples, enc)
        wall = time.perf_counter() - t
        base = res["build"][enc]["wall_s"]
        per = (wall - base) / (a.more_samples - a.samples)
        res["steady"] = {"encoding": enc, "samples": [a.samples, a.more_samples], "wall_s": [base, wall],
                         "s_per_sample": per, "tokens_per_s": seq / per, "over_floor": per / res["floor_s"],
                         "once_s": base - a.samples * per}
    if a.profile:
        res["profile"] = profile(a, build, seq)
    del teacher
    if a.hf:
        res["hf"] = hf_forward(r, tokens, timed)
    return res


def median_time(fn, reps) -> float:
    """Median wall seconds of fn() over reps calls after one warm-up, the device synchronized around each."""
    import time

    import torch
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return sorted(out)[len(out) // 2]


def measure_floor(teacher, tokens, reps, chunk_size=None):
    """(the teacher's output, its hidden states [s, H], {forward_s, output_gemm_s, floor_s}): the bare forward
    (output layer bypassed) and the output GEMM over the row chunks the top-K uses."""
    import torch
    from megatron_kd.parallel.limits import rows_per_chunk
    box = {}

    def fwd():
        box["out"] = teacher(tokens)

    res = {"forward_s": median_time(fwd, reps)}
    out = box.pop("out")
    hidden = out.hidden.reshape(-1, out.hidden.shape[-1])
    w = out.weight.to(hidden.dtype)
    step = chunk_size or rows_per_chunk(w.shape[0])

    def gemm():
        for i in range(0, hidden.shape[0], step):
            torch.mm(hidden[i:i + step], w.t())

    res["output_gemm_s"] = median_time(gemm, reps)
    res["floor_s"] = res["forward_s"] + res["output_gemm_s"]
    return out, hidden, res


def profile(a, build, seq) -> dict:
    """GPU time by kernel kind, GPU busy vs wall, copies and syncs, over a build of a.profile_samples samples."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    trace = os.path.join(tempfile.mkdtemp(prefix="tp_trace_"), "trace.json")
    from megatron_kd.cache import writer as writer_mod
    from megatron_kd.parallel import topk as topk_mod
    from megatron_kd.teacher import build as build_mod
    patched = [(build_mod, "_teacher_topk", "kd.teacher_forward_and_topk"),
               (build_mod, "_start_teacher_topk", "kd.queue_forward_and_topk"),
               (topk_mod.PendingTopK, "result", "kd.take_result"),  # the builder's wait for a micro-batch's top-K
               (topk_mod.PendingTopK, "host_result", "kd.take_result"),
               (writer_mod.ShardWriter, "add", "kd.encode_and_write"),
               (writer_mod.ShardWriter, "append", "kd.write")]
    try:
        from megatron_kd.teacher import sink as sink_mod
        patched.append((sink_mod, "encode_sample", "kd.encode_on_workers"))
    except ImportError:  # a tree that encodes inline
        pass
    saved = []
    for owner, attr, label in patched:  # host wall time of the phases, in whichever thread runs them
        fn = getattr(owner, attr, None)
        if fn is None:
            continue
        saved.append((owner, attr, fn))

        def wrapped(*args, _fn=fn, _label=label, **kw):
            with torch.profiler.record_function(_label):
                return _fn(*args, **kw)
        setattr(owner, attr, wrapped)
    t = time.perf_counter()
    with tprofile(activities=acts) as prof:
        build("profiled", a.profile_samples, a.encodings.split(",")[0])
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t
    for owner, attr, fn in saved:
        setattr(owner, attr, fn)
    prof.export_chrome_trace(trace)
    events = json.load(open(trace))["traceEvents"]
    kinds, busy, d2h, syncs, host = {}, [], 0.0, {"count": 0, "us": 0.0}, {}
    taking = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
              if e.get("ph") == "X" and e.get("name") == "kd.take_result"]
    in_take = {"count": 0, "us": 0.0}  # host syncs while taking a result: waits the pipelining should not have
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, nm, dur = e.get("cat", ""), e.get("name", ""), float(e.get("dur", 0))
        if cat == "kernel":
            low = nm.lower()
            kind = next((kd for kd, keys in KINDS if any(s in low for s in keys)), "other")
            kinds[kind] = kinds.get(kind, 0.0) + dur
            busy.append((float(e["ts"]), float(e["ts"]) + dur))
        elif cat == "gpu_memcpy":
            busy.append((float(e["ts"]), float(e["ts"]) + dur))
            if "DtoH" in nm or "Device -> Pageable" in nm or "Device -> Pinned" in nm:
                d2h += dur
        elif cat == "cuda_runtime" and ("Synchronize" in nm or nm in ("cudaMemcpy", "cudaMemcpyAsync")):
            if "Synchronize" in nm or dur > 50:
                syncs["count"] += 1
                syncs["us"] += dur
                if any(a <= float(e["ts"]) <= b for a, b in taking):
                    in_take["count"] += 1
                    in_take["us"] += dur
        elif cat in ("cpu_op", "user_annotation", "python_function") and nm.startswith("kd."):
            host[nm] = host.get(nm, 0.0) + dur
    busy.sort()
    union, end = 0.0, -1.0
    for s, e in busy:
        if e > end:
            union += e - max(s, end)
            end = e
    return {"samples": a.profile_samples, "wall_s": wall, "gpu_busy_s": union / 1e6,
            "gpu_idle_fraction": 1 - union / 1e6 / wall if cuda else None,
            "gpu_s_by_kind": {kd: v / 1e6 for kd, v in sorted(kinds.items(), key=lambda x: -x[1])},
            "d2h_s": d2h / 1e6, "host_wall_s": {nm: v / 1e6 for nm, v in host.items()}, "host_syncs": {"count": syncs["count"], "s": syncs["us"] / 1e6},
            "host_syncs_taking_results": {"count": in_take["count"], "s": in_take["us"] / 1e6},
            "tokens_per_s": a.profile_samples * seq / wall}


def hf_forward(r, tokens, timed) -> dict:
    """transformers' LlamaModel of the teacher's shape, random bf16 weights, SDPA: forward without lm_head."""
    import torch
    import transformers
    m = r.teacher
    if m.position_embedding_type != "rope" or m.num_moe_experts:
        return {"skipped": "transformers reference only for the Llama-shaped teacher"}
    cfg = transformers.LlamaConfig(vocab_size=r.data.vocab_size, hidden_size=m.hidden_size,
                                   intermediate_size=m.ffn_hidden_size, num_hidden_layers=m.num_layers,
                                   num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_query_groups,
                                   head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads,
                                   rms_norm_eps=m.layernorm_epsilon, rope_theta=m.rotary_base,
                                   max_position_embeddings=tokens.shape[1], attn_implementation="sdpa")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = transformers.LlamaModel(cfg).eval()
    torch.set_default_dtype(torch.float32)
    t = tokens.to(dev)
    with torch.no_grad():
        s = timed(lambda: model(input_ids=t, use_cache=False), 3)
    del model
    return {"forward_s": s, "transformers": transformers.__version__}


def run_tree(tree, a) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree), os.environ.get("PYTHONPATH", "")]))
    argv = [sys.executable, os.path.abspath(__file__), "--child", *sys.argv[1:]]
    p = subprocess.run(argv, cwd=os.path.abspath(tree), env=env, capture_output=True, text=True)
    if p.returncode:
        return {"tree": tree, "rc": p.returncode, "log_tail": (p.stdout + p.stderr)[-4000:]}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["tree"] = tree
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trees", nargs="+", default=["."], help="package trees to measure, in order")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    p.add_argument("--layers", type=int, default=None, help="teacher layers (default: the recipe's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the recipe's)")
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--top-k", type=int, default=100)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=None,
                   help="rows per top-K chunk (default: the tree's, about 2**26 logits); the bytes do not depend on it")
    p.add_argument("--encodings", default="fp16,compact")
    p.add_argument("--override", action="append", default=[],
                   help="one more recipe override, after the shape's (repeatable), e.g. teacher.moe_grouped_gemm=true")
    p.add_argument("--more-samples", type=int, default=None,
                   help="one more build of this many samples (> --samples): the steady per-sample cost and what a "
                        "build pays once, from the two walls")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-samples", type=int, default=2)
    p.add_argument("--hf", action="store_true")
    p.add_argument("--plain-rope", action="store_true",
                   help="teacher.rope_scaling=false in trees that have the key: the same teacher as an older tree's")
    p.add_argument("--smoke", action="store_true", help="tiny CPU shape: checks the script only")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out")
    a = p.parse_args()
    if a.smoke:
        a.shape = "smoke"
    if a.child:
        print(json.dumps(child(a), default=str))
        return
    from common import environment
    runs = [run_tree(t, a) for t in a.trees]
    res = {"benchmark": "teacher pass vs its floor (bare forward + output GEMM)", "env": environment(),
           "args": vars(a), "runs": runs}
    ok = [r for r in runs if "build" in r]
    if len(ok) >= 2:
        base, new = ok[0], ok[-1]
        res["checks"] = {enc: {"shards_byte_identical": base["build"][enc]["shard_sha256"] == new["build"][enc][
            "shard_sha256"], "tokens_per_s_new_over_old": new["build"][enc]["tokens_per_s"] / base["build"][enc][
            "tokens_per_s"], "new_over_floor": new["build"][enc]["over_floor"]} for enc in new["build"]}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    brief = [{k: r.get(k) for k in ("tree", "rc", "forward_s", "output_gemm_s", "topk_s", "floor_s", "log_tail")}
             | {"build": {e: {x: v[x] for x in ("tokens_per_s", "s_per_sample", "over_floor", "peak_gib")}
                          for e, v in r.get("build", {}).items()}, "steady": r.get("steady"), "profile": r.get("profile"),
                                            "hf": r.get("hf")}
             for r in runs]
    print(json.dumps({"runs": brief, "checks": res.get("checks")}, indent=1, default=str))


if __name__ == "__main__":
    main()
