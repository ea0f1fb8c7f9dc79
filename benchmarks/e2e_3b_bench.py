"""End to end, one H200 (issue 8, part 1): a 3.2B student at 8K and 32K, ours against what users run today.

Every variant runs in its own Python process (clean allocator, an OOM cannot poison the next one, and
megatron-core's DDP keeps each model alive through a reference cycle), in this order per sequence length:
  hf_chunked   transformers LlamaForCausalLM (Llama-3.2-3B shape), SDPA, gradient checkpointing, fp32 master
               weights + bf16 autocast, fused AdamW; top-K KL over 1,024-token chunks, each chunk under
               torch.utils.checkpoint (recomputed in backward): the baseline of the bars
  hf_dense     the same with the dense top-K KL (whole [s, V] logits)
  ours_fused   Megatron-Core GPTModel, same shape (3.21 B, vocab 128256, tied embeddings), bf16, local spec with
               SDPA core attention, full recompute, DDP (fp32 main_grad) + Megatron's distributed Adam
               (torch AdamW switched to its fused kernel), our hook (hidden states, no logits) + topk_kl_loss
               impl "fused" (falls back to "chunked" without the Triton kernel; the row says which ran)
  ours_fused_bf16grad  the same with a bf16 DDP grad buffer (grad_reduce_in_fp32 off: main_grad = bf16 wgrad
               at one micro-batch; the optimizer step makes an fp32 copy)
  ours_fused_lean  train.optimizer=lean_adam: bf16 grad buffer, bf16 weights + int16 master remainder (exact
               fp32 master), exp_avg bf16, exp_avg_sq fp32, in Megatron's FP32Optimizer: 12 B/param, not 18
  ours_dense   ours with the dense loss impl
  ours_online  ours + a Llama-3.1-8B-shaped Megatron teacher in memory (bf16, no grad): teacher top-100 on the
               fly (megatron_kd.parallel.topk.topk_from_hidden) + the fused loss. OOM is a result.
Synthetic offline top-100 teacher; random weights; micro-batch 1; median of --steps timed steps after
--warmup; peak = torch.cuda.max_memory_allocated over the timed steps (GiB = 2^30 B and GB = 1e9 B both
recorded). Model TFLOP/s = (6 x params x tokens + 6 x layers x seq^2 x hidden) / step time, params =
3,212,749,824 (embeddings included, no recompute counted). Bars, per sequence: ours_fused peak <= 0.9 x
hf_chunked and TFLOP/s >= 1.15 x hf_chunked (summary["bars"]). megatron_kd.plan's prediction is recorded next
to each ours_* row.

GPU (the lead; megatron-core 0.19.2 + deps carried as cp312 wheels in /tmp/site), about 7-8 minutes:
  PYTHONPATH=/tmp/site:$PWD python benchmarks/e2e_3b_bench.py --out benchmarks/results/e2e_3b_h200.json
  (subset: --seqs 32768 --variants hf_chunked ours_fused; budget guard: --budget-s, default 510)
CPU smoke (tiny shapes, same code paths, transformers needed for the hf_* rows), about 1-2 minutes:
  python benchmarks/e2e_3b_bench.py --smoke --out /tmp/e2e_smoke.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

VARIANTS = ["hf_chunked", "hf_dense", "ours_fused", "ours_fused_bf16grad", "ours_fused_lean", "ours_dense",
            "ours_online"]
GIB = float(1 << 30)


def shapes(smoke: bool):
    from megatron_kd.plan import ModelShape, preset
    if smoke:
        return (ModelShape("llama-tiny", 2, 64, 4, 2, 16, 128, 1024, tie_embeddings=True),
                ModelShape("llama-tiny-teacher", 2, 96, 6, 2, 16, 192, 1024))
    return preset("llama-3.2-3b"), preset("llama-3.1-8b")


def model_flops(shape, seq: int) -> float:
    from megatron_kd.plan import total_params
    return 6.0 * total_params(shape) * seq + 6.0 * shape.num_layers * seq * seq * shape.hidden_size


# ---------------------------------------------------------------------------------------------- baseline

def hf_model(shape, device):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.ffn_hidden_size,
                      num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_attention_heads,
                      num_key_value_heads=shape.num_query_groups, head_dim=shape.kv_channels,
                      tie_word_embeddings=shape.tie_embeddings, max_position_embeddings=131072,
                      rope_theta=500000.0, rms_norm_eps=1e-5, use_cache=False, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.to(torch.float32)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def topk_kl_dense(hidden, weight, ids, logp):
    """Plain PyTorch: whole logits, log-softmax, gather the teacher's ids. Mean over tokens of
    sum_k p_k (log p_k - log q_k) (top-K teacher not renormalized, as our tail='none')."""
    logits = hidden @ weight.t()
    lq = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.long())
    p = logp.exp()
    return (p * (logp - lq)).sum(-1).mean()


def topk_kl_chunked(hidden, weight, ids, logp, chunk=1024):
    """The simple chunked loss: 1,024 tokens at a time, each chunk recomputed in backward (checkpoint)."""
    from torch.utils.checkpoint import checkpoint

    def part(h, w, i, lp):
        lq = torch.log_softmax((h @ w.t()).float(), dim=-1).gather(-1, i.long())
        return (lp.exp() * (lp - lq)).sum()

    total = hidden.new_zeros((), dtype=torch.float32)
    n = hidden.shape[0]
    for a in range(0, n, chunk):
        total = total + checkpoint(part, hidden[a:a + chunk], weight, ids[a:a + chunk], logp[a:a + chunk],
                                   use_reentrant=False)
    return total / n


def run_hf(variant, shape, seq, args, dev):
    from megatron_kd.plan import measure as M
    model = hf_model(shape, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=True)
    batch = M.synthetic_batch(shape, seq, args.topk, dev)
    tokens = batch["tokens"]
    ids = batch["topk_ids"].reshape(seq, args.topk)
    logp = batch["topk_logprobs"].reshape(seq, args.topk)
    loss_fn = topk_kl_dense if variant == "hf_dense" else topk_kl_chunked
    dtype = torch.bfloat16

    def step():
        with torch.autocast(device_type=dev.type, dtype=dtype):
            hidden = model.model(input_ids=tokens).last_hidden_state[0]
            loss = loss_fn(hidden, model.lm_head.weight, ids, logp)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return timed(step, args, dev), dict(loss=loss_fn.__name__, master="fp32 params + bf16 autocast",
                                        optimizer="torch AdamW fused", checkpointing="full (use_reentrant=False)")


# ---------------------------------------------------------------------------------------------- ours

def run_ours(variant, shape, teacher_shape, seq, args, dev):
    from megatron_kd.plan import Layout
    from megatron_kd.plan import measure as M
    lay = Layout()
    M.init_parallel(lay)
    grad_fp32 = variant != "ours_fused_bf16grad"
    impl = "dense" if variant == "ours_dense" else "fused"
    if impl == "fused":
        from megatron_kd.kernels import fused_available
        impl = "fused" if fused_available() else "chunked"
    ddp, opt, info = M.build_training(shape, lay, recompute=args.recompute, grad_fp32=grad_fp32, adam="fused",
                                      optimizer="lean_adam" if variant == "ours_fused_lean" else "adam")
    batch = M.synthetic_batch(shape, seq, args.topk, dev)
    teacher_fn = None
    if variant == "ours_online":
        teacher_fn = make_teacher(teacher_shape, lay, seq, args.topk, dev)
        info["teacher"] = teacher_shape.name
    info["loss_impl"] = impl

    def step():
        return M.train_step(ddp, opt, batch, shape, lay, impl, teacher_fn=teacher_fn)["loss"]

    res = timed(step, args, dev)
    res["plan"] = plan_for(variant, shape, teacher_shape, seq, args, impl, info)
    return res, info


def make_teacher(tshape, lay, seq, k, dev):
    from megatron_kd.parallel.topk import topk_from_hidden
    from megatron_kd.plan.build import build_gpt, hidden_states_forward, output_weight, transformer_config
    cfg = transformer_config(tshape, lay, recompute="none", cpu=dev.type == "cpu")
    teacher = build_gpt(tshape, lay, cfg)
    teacher = teacher.cuda() if dev.type == "cuda" else teacher.bfloat16()
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    def fn(batch):
        with torch.no_grad():
            h = hidden_states_forward(teacher, batch["tokens"], batch["position_ids"])  # [s, 1, H]
            ids, lp = topk_from_hidden(h.reshape(-1, h.shape[-1]), output_weight(teacher), k,
                                       valid_vocab_size=tshape.vocab_size)
        return ids.view(seq, 1, k), lp.view(seq, 1, k)
    return fn


def plan_for(variant, shape, teacher_shape, seq, args, impl, info):
    try:
        from megatron_kd.plan import Layout, Training, plan_memory
        tr = Training(seq_len=seq, recompute=args.recompute, loss=impl if impl != "fused" else "fused",
                      main_grad_fusion=impl == "fused", grad_fp32=info["grad_fp32"],
                      optimizer=info.get("optimizer", "adam"),
                      topk=args.topk, adam_impl=info["adam_impl"] if info["adam_impl"] != "lean_adam" else "fused",
                      mode="online" if variant == "ours_online" else "offline",
                      teacher=teacher_shape if variant == "ours_online" else None, cache_buffers=1,
                      fused_norm=torch.cuda.is_available())
        p = plan_memory(shape, Layout(), tr)
        return dict(peak_gib=p.peak_gib, phase=p.peak_phase, phases_gib={k: v / GIB for k, v in p.phases.items()})
    except Exception as e:  # noqa: BLE001
        return dict(error=repr(e))


# ---------------------------------------------------------------------------------------------- timing

def timed(step, args, dev):
    from megatron_kd.plan.measure import Meter
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    losses = []
    for _ in range(args.warmup):
        losses.append(step())
    meter = Meter()
    times = []
    with meter:
        meter.reset()
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            losses.append(step())
            sync()
            times.append(time.perf_counter() - t0)
        peak = meter.peak()
    res = dict(step_s=statistics.median(times), step_s_all=times, peak_bytes=peak, peak_gib=peak / GIB,
               peak_gb=peak / 1e9, losses=losses)
    if cuda:
        res["max_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    return res


# ---------------------------------------------------------------------------------------------- driver

def run_variant(args) -> dict:
    """--one: a single variant in this process; prints one JSON line."""
    from megatron_kd.plan import measure as M
    shape, tshape = shapes(args.smoke)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    row = dict(variant=args.one, seq=args.seq_one, status="ok")
    t0 = time.time()
    try:
        if args.one.startswith("ours"):
            M.init_distributed()
            res, info = run_ours(args.one, shape, tshape, args.seq_one, args, dev)
        else:
            res, info = run_hf(args.one, shape, args.seq_one, args, dev)
        row.update(res)
        row["info"] = info
        row["tflops"] = model_flops(shape, args.seq_one) / res["step_s"] / 1e12
    except Exception as e:  # noqa: BLE001
        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()
        row.update(status="oom" if oom else "error", error=repr(e)[:2000], traceback=traceback.format_exc()[-3000:])
        if torch.cuda.is_available():
            row["peak_gib_at_failure"] = torch.cuda.max_memory_allocated() / GIB
    row["seconds"] = time.time() - t0
    return row


def summarize(rows, seqs):
    """Per sequence: each ours_fused* variant against hf_chunked (the bars: memory <= 0.9x, TFLOP/s >= 1.15x)."""
    out = {}
    for s in seqs:
        ok = {r["variant"]: r for r in rows if r["seq"] == s and r["status"] == "ok"}
        base = ok.get("hf_chunked")
        d = dict(baseline=bool(base), ours="ours_fused" in ok, variants={})
        for name in ("ours_fused", "ours_fused_bf16grad", "ours_fused_lean"):
            if base and name in ok:
                v = dict(mem_ratio=ok[name]["peak_bytes"] / base["peak_bytes"],
                         tflops_ratio=ok[name]["tflops"] / base["tflops"])
                v.update(mem_bar_met=v["mem_ratio"] <= 0.9, tflops_bar_met=v["tflops_ratio"] >= 1.15)
                d["variants"][name] = v
        d.update(d["variants"].get("ours_fused", {}))
        out[str(s)] = d
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="JSON results (driver mode)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the logic)")
    ap.add_argument("--seqs", type=int, nargs="+", default=None)
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--recompute", default="full", choices=("full", "selective", "none"))
    ap.add_argument("--budget-s", type=float, default=510.0, help="skip variants once this much time has passed")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--seq-one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.topk = min(args.topk, 16)
    if args.one:
        print("E2E_ROW " + json.dumps(run_variant(args), default=str), flush=True)
        return 0
    if not args.out:
        ap.error("--out is required")
    seqs = args.seqs or ([128, 256] if args.smoke else [8192, 32768])
    from common import environment
    result = dict(env=environment(), args=vars(args), rows=[],
                  flops_formula="(6 x params x tokens + 6 x layers x seq^2 x hidden) / step time; params = "
                                "3,212,749,824 (embeddings included); recompute not counted")
    t_start = time.time()
    for seq in seqs:
        for v in args.variants:
            if time.time() - t_start > args.budget_s:
                result["rows"].append(dict(variant=v, seq=seq, status="skipped (time budget)"))
                continue
            cmd = [sys.executable, os.path.abspath(__file__), "--one", v, "--seq-one", str(seq),
                   "--topk", str(args.topk), "--warmup", str(args.warmup), "--steps", str(args.steps),
                   "--recompute", args.recompute] + (["--smoke"] if args.smoke else [])
            t0 = time.time()
            p = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("E2E_ROW ")), None)
            if line:
                row = json.loads(line[len("E2E_ROW "):])
            else:
                row = dict(variant=v, seq=seq, status="crashed", returncode=p.returncode,
                           stderr=p.stderr[-3000:], oom="out of memory" in p.stderr.lower())
            row["wall_s"] = time.time() - t0
            result["rows"].append(row)
            msg = (f"{v:<22} seq {seq:>6}: {row['status']}")
            if row["status"] == "ok":
                msg += (f"  {row['step_s']:.3f} s/step  peak {row['peak_gib']:.2f} GiB ({row['peak_gb']:.1f} GB)  "
                        f"{row['tflops']:.1f} TFLOP/s" + (f"  [{row['info'].get('loss_impl', '')}]"
                                                          if v.startswith("ours") else ""))
                if "plan" in row and "peak_gib" in row["plan"]:
                    msg += f"  plan {row['plan']['peak_gib']:.2f} GiB"
            print(msg + f"  ({row['wall_s']:.0f} s)", flush=True)
            save(args.out, result)
    result["summary"] = summarize(result["rows"], seqs)
    result["seconds"] = time.time() - t_start
    save(args.out, result)
    print(json.dumps(result["summary"], indent=1))
    return 0


def save(path, payload):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
