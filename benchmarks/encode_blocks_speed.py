"""One sample's encoding (encode, decode check, statistics) whole vs in blocks of positions on worker threads, as the
cache builder runs the sample that nothing overlaps (the last of a build). Same process, alternating, medians;
bytes and statistics compared.

CPU: python benchmarks/encode_blocks_speed.py --out benchmarks/results/encode_blocks_speed_cpu.json
"""
import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def sample(seq, k, vocab, seed=0):
    """LLM-like rows: K distinct ids, log-probs sorted descending, about 0.9 of the mass in the top K."""
    g = np.random.default_rng(seed)
    ids = np.stack([g.choice(vocab, k, replace=False) for _ in range(256)])
    ids = np.tile(ids, (seq // 256 + 1, 1))[:seq]
    x = np.sort(g.standard_normal((seq, k)) * 2, axis=1)[:, ::-1]
    lp = (x - np.log(np.exp(x).sum(axis=1, keepdims=True)) - 0.1).astype(np.float32)
    return ids, lp, g.integers(0, vocab, size=seq)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--top-k", type=int, default=100)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out")
    a = p.parse_args()
    from common import environment
    from megatron_kd.cache.encoding import get_encoding
    from megatron_kd.cache.writer import encode_sample
    ids, lp, tok = sample(a.seq, a.top_k, a.vocab)
    res = {"benchmark": "encode_sample whole vs blocks of positions on threads", "env": environment(),
           "args": vars(a), "encodings": {}}
    with ThreadPoolExecutor(a.threads) as pool:
        def run(fs):
            return list(pool.map(lambda f: f(), fs))
        for name in ("fp16", "compact"):
            enc = get_encoding(name, a.vocab, a.top_k, a.seq)
            whole, blocks = [], []
            for _ in range(a.rounds):
                t = time.perf_counter()
                w = encode_sample(enc, a.seq, ids, lp, tok)
                whole.append(time.perf_counter() - t)
                t = time.perf_counter()
                b = encode_sample(enc, a.seq, ids, lp, tok, run=run)
                blocks.append(time.perf_counter() - t)
            same = w.buf.tobytes() == b.buf.tobytes() and w.stats == b.stats and w.crc == b.crc
            res["encodings"][name] = {"whole_s": statistics.median(whole), "blocks_s": statistics.median(blocks),
                                      "speedup": statistics.median(whole) / statistics.median(blocks),
                                      "identical": same}
            print(name, res["encodings"][name], flush=True)
    res["load_after"] = os.getloadavg()[0]
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
