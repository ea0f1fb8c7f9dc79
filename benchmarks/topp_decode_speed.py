"""Decode speed (tokens/s, one process) and size of the topp encoding against compact, on the same rows.

Two row sets: LLM-like rows at the GPT-OSS vocabulary (V=201,088, K=100, S=4,096; Zipf logits of steepness
0.7-2.5 plus noise over a random id order, as tests/cache/test_cache_encoding.py) and, when --demo-cache is given,
the demo teacher's real rows (a K=100 fp16 cache, e.g. runs/topp_fidelity/cache from topp_fidelity.py). Each
sample is encoded once per encoding; decoding a whole sample is timed, the encodings interleaved, the median of
--reps rounds. --baseline TREE also times compact's decode from another checkout (e.g. /work/main: today's
compact), loaded in this process and interleaved with the others, and checks its bytes equal this tree's compact's.

    python benchmarks/topp_decode_speed.py --demo-cache runs/topp_fidelity/cache --baseline /work/main

Writes benchmarks/results/topp_decode_speed_cpu.json; prints a table.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
TOP_PS = (0.9, 0.99, 0.999, 0.9999)

def baseline_encoding_module(tree: str):
    """The encoding module of another checkout, loaded beside this tree's under another package name (its
    encoding module imports only its own bits.py and topp.py), so both are timed in one process, interleaved."""
    import importlib
    import shutil
    import tempfile
    src = os.path.join(os.path.abspath(tree), "megatron_kd", "cache")
    pkg = os.path.join(tempfile.mkdtemp(), "kd_baseline_cache")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    for name in ("bits.py", "encoding.py", "topp.py", "encoding"):  # encoding: a folder, one file per encoding
        if os.path.isdir(os.path.join(src, name)):
            shutil.copytree(os.path.join(src, name), os.path.join(pkg, name))
        elif os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), pkg)
    sys.path.insert(0, os.path.dirname(pkg))
    return importlib.import_module("kd_baseline_cache.encoding")


def llm_rows(samples, S, V, K, seed=0):
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "cache"))
    from test_cache_encoding import teacher_topk
    ids, lp = [], []
    for i in range(samples):
        chunk_ids, chunk_lp = [], []
        for a in range(0, S, 128):  # 128 rows of the full vocabulary at a time (about 200 MB in float64)
            x, y, _ = teacher_topk(min(128, S - a), V, K, seed=seed + 100000 * i + a)
            chunk_ids.append(x)
            chunk_lp.append(y)
        ids.append(np.concatenate(chunk_ids))
        lp.append(np.concatenate(chunk_lp))
    return np.stack(ids), np.stack(lp)


def demo_rows(path, samples):
    from megatron_kd.cache import CacheReader
    r = CacheReader(path)
    picks = np.unique(np.linspace(0, len(r) - 1, num=min(samples, len(r))).astype(np.int64))
    rows = [r[int(i)] for i in picks]
    return np.stack([x["topk_ids"] for x in rows]), np.stack([x["topk_logprobs"] for x in rows]), r.vocab_size


def measure(ids, lp, V, reps, top_ps, baseline=None) -> dict:
    from megatron_kd.cache.encoding import get_encoding
    n, S, K = ids.shape
    encs = {"compact": get_encoding("compact", V, K, S)}
    if baseline:
        encs["baseline_compact"] = baseline_encoding_module(baseline).get_encoding("compact", V, K, S)
    encs.update({f"topp_{P}": get_encoding("topp", V, K, S, top_p=P) for P in top_ps})
    bufs = {name: [e.encode(ids[i], lp[i]) for i in range(n)] for name, e in encs.items()}
    times = {name: [] for name in encs}
    for _ in range(reps):  # interleaved: a load change hits every encoding alike
        for name, e in encs.items():
            t = time.perf_counter()
            for b in bufs[name]:
                e.decode(b)
            times[name].append(time.perf_counter() - t)
    out = {"samples": int(n), "seq_length": int(S), "top_k": int(K), "vocab_size": int(V), "reps": reps, "rows": {}}
    for name, e in encs.items():
        nbytes = sum(b.size for b in bufs[name])
        row = {"bytes_per_token": nbytes / (n * S), "tokens_per_s": n * S / float(np.median(times[name])),
               "tokens_per_s_rounds": [n * S / t for t in times[name]],
               "tokens_per_s_best": n * S / float(np.min(times[name]))}
        if name.startswith("topp"):
            row["kept_k_mean"] = float(np.mean([e.counts(b).mean() for b in bufs[name]]))
            row["bytes_per_token_with_offsets"] = (nbytes + 8 * n) / (n * S)
        out["rows"][name] = row
    base = out["rows"]["compact"]["tokens_per_s"]
    for row in out["rows"].values():
        row["speed_vs_compact"] = row["tokens_per_s"] / base
    if baseline:
        same = all(np.array_equal(a, b) for a, b in zip(bufs["compact"], bufs["baseline_compact"]))
        out["baseline"] = {"tree": os.path.abspath(baseline), "compact_tokens_per_s":
                           out["rows"]["baseline_compact"]["tokens_per_s"], "compact_bytes_identical": bool(same)}
        for row in out["rows"].values():
            row["speed_vs_baseline_compact"] = row["tokens_per_s"] / out["baseline"]["compact_tokens_per_s"]
    return out


def table(name, m) -> str:
    lines = [f"{name}: {m['samples']} samples x S={m['seq_length']}, K={m['top_k']}, V={m['vocab_size']}",
             "| encoding | mean kept K | bytes/token | decode tokens/s | vs compact |"
             + (" vs baseline compact |" if "baseline" in m else ""), "|---|---|---|---|---|"
             + ("---|" if "baseline" in m else "")]
    for enc, r in m["rows"].items():
        lines.append(f"| {enc} | {r.get('kept_k_mean', m['top_k']):.2f} | {r['bytes_per_token']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['speed_vs_compact']:.2f}x |"
                     + (f" {r['speed_vs_baseline_compact']:.2f}x |" if "baseline" in m else ""))
    if "baseline" in m:
        b = m["baseline"]
        lines.append(f"baseline compact ({b['tree']}): {b['compact_tokens_per_s']:,.0f} tokens/s; compact bytes "
                     f"identical to this tree's: {b['compact_bytes_identical']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=4, help="LLM-like samples of --seq-length positions")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--demo-cache", default=None, help="a K=100 fp16 cache of the demo teacher to read rows from")
    p.add_argument("--demo-samples", type=int, default=64)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--rows-dir", default="runs/topp_decode_speed", help="where the generated rows are kept")
    p.add_argument("--baseline", default=None, help="another checkout whose compact decode is timed too")
    p.add_argument("--results", default=os.path.join(HERE, "results", "topp_decode_speed_cpu.json"))
    a = p.parse_args(argv)
    from common import environment
    res = {"benchmark": "decode speed and size: topp vs compact", "device": "CPU", "cpu_cores": os.cpu_count(),
           "command": "python benchmarks/topp_decode_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "environment": environment(), "load_average": os.getloadavg(), "sets": {}}
    rows = os.path.join(a.rows_dir, f"llm_rows_{a.samples}x{a.seq_length}.npz")
    if os.path.exists(rows):
        d = np.load(rows)
        ids, lp = d["ids"], d["lp"]
    else:
        ids, lp = llm_rows(a.samples, a.seq_length, 201088, 100)
        os.makedirs(a.rows_dir, exist_ok=True)
        np.savez(rows, ids=ids, lp=lp)
    res["sets"]["llm_like_v201088"] = measure(ids, lp, 201088, a.reps, TOP_PS, a.baseline)
    print(table("LLM-like rows", res["sets"]["llm_like_v201088"]), flush=True)
    if a.demo_cache:
        ids, lp, V = demo_rows(a.demo_cache, a.demo_samples)
        res["sets"]["demo_teacher"] = measure(ids, lp, V, a.reps, TOP_PS, a.baseline)
        print(table("demo teacher rows", res["sets"]["demo_teacher"]), flush=True)
    res["load_average_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(os.path.abspath(a.results)), exist_ok=True)
    with open(a.results, "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
