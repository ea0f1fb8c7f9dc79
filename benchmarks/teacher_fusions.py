"""The teacher's forward with and without the exact elementwise fusions (kernels/swiglu.py, kernels/rope.py), one call.

On the recipe's teacher (random bf16 weights, mock tokens): the kernels' outputs against eager's on real-sized
tensors (bit equality), the forward's time and its hidden states with and without the fusions (bit equality), and
torch.profiler's top kernels of one forward each way.

H200: python benchmarks/teacher_fusions.py --out benchmarks/results/teacher_fusions_h200.json
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def top_kernels(fn, n=25):
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            r = rows.setdefault(e.name[:90], [0, 0.0])
            r[0] += 1
            r[1] += e.device_time_total / 1e3 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e3
    top = sorted(rows.items(), key=lambda kv: -kv[1][1])
    total = sum(v[1] for v in rows.values())
    return {"total_ms": total, "top": [{"name": k, "count": v[0], "ms": round(v[1], 3)} for k, v in top[:n]]}


def kernel_checks():
    import torch
    import torch.nn.functional as F
    from megatron_kd.kernels.rope import rope_eager
    from megatron_kd.kernels.swiglu import swiglu_eager
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    g = torch.Generator(device="cuda").manual_seed(1)
    out = {}
    for scale in (0.5, 4.0, 40.0):
        x = (torch.randn(8192, 2 * 14336, device="cuda", generator=g) * scale).bfloat16()
        a, b = torch.chunk(x, 2, dim=-1)
        ref = F.silu(a) * (b + 0.0)
        got = swiglu_eager(x, 0.0)
        out[f"swiglu_scale{scale}_mismatch"] = int((ref.view(torch.int16) != got.view(torch.int16)).sum())
    s, d = 8192, 128
    mixed = torch.randn(s, 1, 8, 6 * d, device="cuda", generator=g).bfloat16()  # [s, b, ng, (np/ng + 2) hn]
    q, k, _ = torch.split(mixed, [4 * d, d, d], dim=3)
    q = q.reshape(s, 1, -1, d)
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.outer(torch.arange(s, device="cuda").float(), inv)
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    for name, t in (("q", q), ("k_strided", k)):
        ref = _apply_rotary_pos_emb_bshd(t, freqs)
        cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
        got = rope_eager(t, cos, sin)
        out[f"rope_{name}_mismatch"] = int((ref.view(torch.int16) != got.view(torch.int16)).sum())
    from megatron_kd.kernels.rmsnorm import rms_norm_eager
    for scale in (0.02, 1.0, 30.0):
        x = (torch.randn(16384, 1, 4096, device="cuda", generator=g) * scale).bfloat16()
        w = 1 + 0.1 * torch.randn(4096, device="cuda", generator=g)  # fp32: the weights torch's composite takes
        ref = torch.nn.functional.rms_norm(x, (4096,), w, 1e-5)
        got = rms_norm_eager(x, w, 1e-5)
        out[f"rmsnorm_scale{scale}_mismatch"] = int((ref.view(torch.int16) != got.view(torch.int16)).sum())
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="llama31_8b_to_3b_32k_1xh200")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args()
    import numpy as np
    import torch
    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import to_recipe
    from megatron_kd.teacher.megatron import start_cache_teacher

    res = {"kernels": kernel_checks()}
    print(json.dumps(res), flush=True)
    over = ["kd.cache=/dev/null"] + ([f"teacher.num_layers={a.layers}"] if a.layers else [])
    r = to_recipe(compose(a.recipe, over, save="/dev/null"))
    teacher = start_cache_teacher(r, r.data.vocab_size)
    seq = r.data.seq_length
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, r.data.vocab_size, size=(1, seq)))

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(a.reps):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        return sorted(ts)[len(ts) // 2]

    box = {}
    teacher.exact_fusions = False
    res["plain_forward_s"] = timed(lambda: box.__setitem__("h", teacher(tokens).hidden))
    ref = box.pop("h").clone()
    res["plain_profile"] = top_kernels(lambda: teacher(tokens))
    teacher.exact_fusions = True
    res["fused_forward_s"] = timed(lambda: box.__setitem__("h", teacher(tokens).hidden))
    res["fused_profile"] = top_kernels(lambda: teacher(tokens))
    got = box.pop("h")
    res["hidden_bit_identical"] = bool(torch.equal(ref.view(torch.int16), got.view(torch.int16)))
    res["hidden_mismatches"] = int((ref.view(torch.int16) != got.view(torch.int16)).sum())
    res["fused_over_plain"] = res["fused_forward_s"] / res["plain_forward_s"]
    print(json.dumps({k: v for k, v in res.items() if "profile" not in k}), flush=True)
    for k in ("plain_profile", "fused_profile"):
        print(k, res[k]["total_ms"])
        for row in res[k]["top"]:
            print(f"  {row['ms']:9.3f} ms {row['count']:5d}  {row['name']}")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
