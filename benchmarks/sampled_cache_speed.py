"""Cache build speed with sampling (encoding "sampled", N draws per position) against top-K, in one call.

On the recipe's 8B teacher (random weights, mock tokens, 32K positions per sample), one process:
  floor     the teacher's bare forward (output layer bypassed) and the output GEMM alone over the top-K's row chunks;
  select    on the same hidden states: topk_from_hidden (K=100) and the vocab-parallel sampler for each N
            (output GEMM included in both);
  build     build_cache end to end per cache kind (fp16 and compact top-K 100, sampled N for each --draws), tokens/s,
            bytes/token written, mean distinct ids per position, peak memory, every shard's sha256;
  layout    the first sampled N rebuilt with another micro-batch size and row chunk: its shards' sha256 must match.

H200 (carry .whl-bridge, from ../shared/bridge/fetch_wheels.sh; about 2 minutes):
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-bridge/*.whl
  PYTHONPATH=/tmp/site:$PWD python3 benchmarks/sampled_cache_speed.py --out $OUT/sampled_cache_speed_h200.json
CPU check of the script (times mean nothing): python benchmarks/sampled_cache_speed.py --tiny
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from teacher_pass import SHAPES, measure_floor, median_time  # noqa: E402  teacher_pass.py's shapes and floor


def run(a) -> dict:
    import numpy as np
    import torch

    from megatron_kd.parallel.sample import start_sample_from_hidden
    from megatron_kd.parallel.topk import topk_from_hidden
    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import to_recipe
    from megatron_kd.cache.encoding import EncodingOptions
    from megatron_kd.teacher.build import build_cache
    from megatron_kd.teacher.megatron import start_cache_teacher

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    name, over = SHAPES["smoke" if a.tiny else a.shape]
    over = list(over) + ([f"teacher.num_layers={a.layers}"] if a.layers else []) + (
        [f"data.seq_length={a.seq}"] if a.seq else [])
    r = to_recipe(compose(name, over + ["kd.cache=/dev/null"], save="/dev/null"))
    vocab, seq, k = r.data.vocab_size, r.data.seq_length, a.top_k
    draws = [int(x) for x in a.draws.split(",")]
    res = {"recipe": name, "overrides": over, "seq_length": seq, "vocab_size": vocab, "top_k": k, "draws": draws,
           "teacher_layers": r.teacher.num_layers, "hidden": r.teacher.hidden_size, "samples": a.samples}
    t0 = time.perf_counter()
    teacher = start_cache_teacher(r, vocab)
    sync()
    res["teacher_init_s"] = time.perf_counter() - t0
    data = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, size=(a.samples + 1, seq + 1)))

    tokens = data[0, :seq][None]
    out, hidden, floor = measure_floor(teacher, tokens, a.reps)
    res.update(floor)
    timed = median_time
    res["topk_s"] = timed(lambda: topk_from_hidden(hidden, out.weight, k, None, None, 1.0, None, vocab), a.reps)
    sample = torch.zeros(hidden.shape[0], dtype=torch.int64)
    position = torch.arange(hidden.shape[0], dtype=torch.int64)
    res["sample_s"] = {str(n): timed(lambda n=n: start_sample_from_hidden(
        hidden, out.weight, n, sample, position, None, None, 1.0, None, vocab).result(), a.reps) for n in draws}
    del out, hidden
    if cuda:
        torch.cuda.empty_cache()
    ident = {"name": "bench", "config_hash": "0", "weights_hash": "0"}
    work = tempfile.mkdtemp(prefix="sampled_speed_")

    def build(path, n, mbs=a.micro_batch_size, chunk=None, **kw):
        return build_cache(teacher, data, os.path.join(work, path), num_samples=n, samples_per_shard=max(1, n // 2),
                           progress=False, dataset_id="bench", teacher_id=ident, micro_batch_size=mbs,
                           chunk_size=chunk, encoding=EncodingOptions.of(**kw))

    kinds = [("fp16", {"top_k": k, "encoding": "fp16"}), ("compact", {"top_k": k, "encoding": "compact"})]
    kinds += [(f"sampled{n}", {"samples": n}) for n in draws]
    build("warm_topk", 1, top_k=k)
    build("warm_sampled", 1, samples=draws[0])
    res["build"] = {}
    for label, kw in kinds:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        m = build(label, a.samples, **kw)
        wall = time.perf_counter() - t
        st = m["stats"]
        res["build"][label] = {
            "wall_s": wall, "s_per_sample": wall / a.samples, "tokens_per_s": a.samples * seq / wall,
            "over_floor": wall / a.samples / res["floor_s"],
            "bytes_per_token": sum(s["bytes"] for s in m["shards"]) / (a.samples * seq),
            "distinct_ids_mean": st["kept_sum"] / st["tokens"] if "kept_sum" in st else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "shard_sha256": [s["sha256"] for s in m["shards"]]}
    first = f"sampled{draws[0]}"
    again = build("layout", a.samples, mbs=2, chunk=777, samples=draws[0])
    res["layout_check"] = {"cache": first, "micro_batch_size": 2, "chunk_size": 777,
                           "shards_byte_identical": [s["sha256"] for s in again["shards"]] ==
                           res["build"][first]["shard_sha256"]}
    base = res["build"]["compact"]["tokens_per_s"]
    res["sampled_over_compact_tokens_per_s"] = {lab: v["tokens_per_s"] / base for lab, v in res["build"].items()
                                                if lab.startswith("sampled")}
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(s for s in SHAPES if s != "smoke"), default="llama8b")
    p.add_argument("--layers", type=int, default=None, help="teacher layers (default: the recipe's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the recipe's, 32K)")
    p.add_argument("--samples", type=int, default=6, help="samples per build")
    p.add_argument("--top-k", type=int, default=100)
    p.add_argument("--draws", default="16,64", help="N of the sampled caches, comma-separated")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny CPU shape: checks the script only")
    p.add_argument("--out")
    a = p.parse_args()
    t = time.perf_counter()
    res = run(a)
    from common import environment
    res = {"benchmark": "cache build: sampled vs top-K, one call", "env": environment(), "args": vars(a), **res,
           "total_s": time.perf_counter() - t}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    brief = {k: res[k] for k in ("forward_s", "output_gemm_s", "topk_s", "sample_s", "layout_check",
                                 "sampled_over_compact_tokens_per_s", "total_s")}
    brief["build"] = {lab: {x: v[x] for x in ("tokens_per_s", "s_per_sample", "over_floor", "bytes_per_token",
                                              "distinct_ids_mean", "peak_gib")} for lab, v in res["build"].items()}
    print(json.dumps(brief, indent=1, default=str))


if __name__ == "__main__":
    main()
