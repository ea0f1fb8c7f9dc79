"""Cache build speed, old code vs new, alternately in one run (CPU, same inputs, same machine).

    git -C /work/main archive ad4c281 | tar -x -C /tmp/old-ad4c281
    python benchmarks/cache_build_speed.py --old /tmp/old-ad4c281 --new . --rounds 7 \
        --out benchmarks/results/cache_build_speed_cpu.json

Each measurement is a fresh subprocess (PYTHONPATH = that tree) that builds a cache from a fixed synthetic
teacher (hidden [b, s, H] x output weight [V, H], the vocab top-K from hidden) into an empty directory and reports
the wall time of build_cache alone (imports excluded). Old and new alternate, so load from other users of a shared
CPU hits both alike; medians are reported.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time, tempfile, os
import numpy as np, torch
torch.set_num_threads(1)
from megatron_kd.teacher.protocol import CallableTeacher
from megatron_kd.cache.encoding import EncodingOptions
from megatron_kd.teacher.build import build_cache
V, H, S, N, K = {V}, {H}, {S}, {N}, {K}
g = torch.Generator().manual_seed(0)
emb, out = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
teacher = CallableTeacher(lambda t: (torch.tanh(emb[t]), out), V, name="bench",
                          identity={{"name": "bench", "config_hash": "0", "weights_hash": "0"}})
data = torch.from_numpy(np.random.default_rng(0).integers(0, V, size=(N, S + 1)))
d = tempfile.mkdtemp(prefix="cache_speed_")
t0, c0 = time.perf_counter(), time.process_time()
build_cache(teacher, data, os.path.join(d, "c"), encoding=EncodingOptions(top_k=K), samples_per_shard={SPS},
            micro_batch_size={MBS}, progress=False, dataset_id="bench")
print(json.dumps({{"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}}))
"""


def measure(tree, sizes) -> float:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    r = subprocess.run([sys.executable, "-c", CHILD.format(**sizes)], env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{tree}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--old", required=True)
    p.add_argument("--new", default=".")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out")
    p.add_argument("--V", type=int, default=4096)
    p.add_argument("--H", type=int, default=64)
    p.add_argument("--S", type=int, default=256)
    p.add_argument("--N", type=int, default=96)
    p.add_argument("--K", type=int, default=32)
    a = p.parse_args()
    sizes = dict(V=a.V, H=a.H, S=a.S, N=a.N, K=a.K, SPS=8, MBS=4)
    runs = {"old": [], "new": []}
    cpu = {"old": [], "new": []}
    for r in range(a.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for name in order:
            m = measure(a.old if name == "old" else a.new, sizes)
            runs[name].append(m["seconds"])
            cpu[name].append(m["cpu_seconds"])
        print(f"round {r}: wall old {runs['old'][-1]:.3f}s new {runs['new'][-1]:.3f}s; "
              f"cpu old {cpu['old'][-1]:.3f}s new {cpu['new'][-1]:.3f}s", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    res = {"what": "build_cache wall and CPU (user+sys of the process) time, imports excluded, fresh subprocess "
                   "per run, old/new alternating; on a shared CPU the CPU time is the fair comparison",
           "cpu_seconds": cpu, "median_cpu_seconds": cmed, "new_over_old_median_cpu": cmed["new"] / cmed["old"],
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": "CPU (shared, 1 torch thread)",
           "sizes": sizes, "old_tree": a.old, "new_tree": a.new, "seconds": runs, "median_seconds": med,
           "new_over_old_median": med["new"] / med["old"]}
    print(json.dumps({"median_seconds": med, "new_over_old_median": res["new_over_old_median"],
                      "median_cpu_seconds": cmed, "new_over_old_median_cpu": res["new_over_old_median_cpu"]}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
