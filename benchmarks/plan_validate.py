"""Validate `megatron-kd plan` against measured peak memory (issue 8, part 2).

A GPT-OSS-20B-shaped student with reduced depth (all 32 experts top-4, hidden 2880, vocab 201088, GQA 64/8,
head dim 64) trains a few KD steps at 32K tokens with Megatron-Core (local spec + SDPA, DDP with fp32
main_grad, distributed Adam, our fused loss on hidden states, synthetic offline top-100). For each layout we
record torch.cuda.max_memory_allocated per phase (forward+loss, backward, optimizer step) after warm-up,
next to megatron_kd.plan's prediction, and check |predicted / measured - 1| <= --tol (10%).

Layouts: 1 GPU: 4 layers full recompute; 2 layers no recompute (exercises the activation model).
         2 GPUs: EP=2 (DP=2: dense params' optimizer state sharded over 2), 2 layers no recompute and
         4 layers full recompute. TP=2 cannot run without TE/apex: Megatron's MoE needs sequence parallelism
         at TP > 1 and its torch norms refuse it (the plan models TP for TE builds; tests check TP counts).
Expert biases are off (add_bias_linear=False; the qkv bias stays): megatron-core's expert MLP adds its bias
in place on a view when EP = ETP = 1 and fails; the plan counts exactly what is built. All layers use full
causal attention (GPT-OSS's sliding windows and sinks need TE).

GPU (the lead; megatron-core 0.19.2 + its deps carried as cp312 wheels in /tmp/site), about 2-3 min each:
  PYTHONPATH=/tmp/site:$PWD torchrun --nproc_per_node 1 benchmarks/plan_validate.py \
      --out benchmarks/results/plan_validate_gptoss_1xh200.json
  PYTHONPATH=/tmp/site:$PWD torchrun --nproc_per_node 2 benchmarks/plan_validate.py \
      --out benchmarks/results/plan_validate_gptoss_2xh200.json
CPU smoke (tiny shapes, gloo, LiveMemory instead of the CUDA allocator; no fused loss, no DistOpt at DP>1):
  torchrun --nproc_per_node 1 benchmarks/plan_validate.py --smoke --out /tmp/pv1.json
  torchrun --nproc_per_node 2 benchmarks/plan_validate.py --smoke --out /tmp/pv2.json
Exit status: 0 when every layout ran and is within --tol, 1 otherwise (the JSON is written either way).
"""
import argparse
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_kd.plan import Layout, Training, plan_memory, preset  # noqa: E402
from megatron_kd.plan import measure as M  # noqa: E402
from megatron_kd.plan.shapes import ModelShape  # noqa: E402

GIB = float(1 << 30)


def student(layers: int, smoke: bool) -> ModelShape:
    if smoke:  # same structure, tiny: 8 experts top-2 keep every expert busy
        return ModelShape("gpt-oss-tiny", layers, 64, 8, 4, 16, 64, 1024, add_qkv_bias=True, num_moe_experts=8,
                          moe_router_topk=2, moe_ffn_hidden_size=64)
    return preset("gpt-oss-20b").with_(num_layers=layers, add_bias_linear=False,
                                       name=f"gpt-oss-20b-shaped ({layers} layers, no expert bias)")


def configs(world: int, smoke: bool):
    if world == 1:
        # smaller first: megatron-core's DDP leaves each model's weights and grad buffer allocated (a
        # reference cycle through autograd hooks); the measurements subtract what was allocated before
        return [dict(name="1gpu_2L_none", layers=2, layout=Layout(), recompute="none"),
                dict(name="1gpu_4L_full", layers=4, layout=Layout(), recompute="full")]
    if world == 2:  # TP=2 is out without TE/apex: MoE at TP > 1 needs SP, and Megatron's torch norms refuse SP
        return [dict(name="2gpu_ep2_2L_none", layers=2, layout=Layout(ep=2, dp=2), recompute="none"),
                dict(name="2gpu_ep2_4L_full", layers=4, layout=Layout(ep=2, dp=2), recompute="full")]
    raise SystemExit(f"plan_validate runs on 1 or 2 ranks, not {world}")


def run_one(c, a, world, rank):
    shape = student(c["layers"], a.smoke)
    lay = c["layout"]
    cpu = not M.on_cuda()
    dist_opt = not (cpu and lay.dp > 1)   # gloo has no reduce-scatter
    impl = a.impl
    if impl == "fused":
        from megatron_kd.kernels import fused_available
        impl = "fused" if fused_available() else "chunked"
    M.init_parallel(lay)
    meter = M.Meter()
    base = meter.current()  # whatever an earlier layout left behind is not this layout's
    dev = torch.device("cuda") if not cpu else torch.device("cpu")
    seq = a.seq
    steps = []
    with meter:
        ddp, opt, info = M.build_training(shape, lay, recompute=c["recompute"], dist_opt=dist_opt, adam="fused")
        # every TP rank of a model replica sees the same sequence; DP/EP replicas differ
        batch = M.synthetic_batch(shape, seq, a.topk, dev, seed=rank // lay.tp)
        for i in range(a.warmup):
            steps.append(M.train_step(ddp, opt, batch, shape, lay, impl))
        for i in range(a.steps):
            r = M.train_step(ddp, opt, batch, shape, lay, impl, meter=meter)
            for k in ("static_bytes", "forward_peak", "backward_peak", "step_peak", "peak", "teacher_peak"):
                if k in r:
                    r[k] -= base
            steps.append(r)
    measured = steps[a.warmup:]
    tr = Training(seq_len=seq, recompute=c["recompute"], loss=impl, main_grad_fusion=(impl == "fused"),
                  topk=a.topk, distributed_optimizer=dist_opt,
                  adam_impl=info["adam_impl"] if info["adam_impl"] in ("fused", "foreach") else "for_loop",
                  fused_norm=not cpu, cache_buffers=1)
    p = plan_memory(shape, lay, tr)
    meas = {k: max(s[k] for s in measured) for k in ("static_bytes", "forward_peak", "backward_peak", "step_peak",
                                                       "peak")}
    phase_pred = dict(forward_peak=p.phases.get("forward end (loss)"),
                      backward_peak=max(p.phases.get("backward", 0), p.phases.get("backward end", 0)),
                      step_peak=p.phases.get("optimizer step"))
    static_pred = p.group_bytes("static")
    res = dict(
        name=c["name"], rank=rank, shape=shape.as_dict(), layout=vars(lay) | dict(etp=lay.expert_tp, sp=lay.sp),
        recompute=c["recompute"], seq=seq, loss_impl=impl, optimizer=info,
        params_local=p.params_local,
        params_built=sum(q.numel() for q in ddp.parameters()),
        measured_gib={k: v / GIB for k, v in meas.items()},
        predicted_gib=dict(peak=p.peak_gib, static=static_pred / GIB,
                           **{k: (v or 0) / GIB for k, v in phase_pred.items()}),
        predicted_phase=p.peak_phase,
        plan=p.as_dict(),
        ratio=p.peak_bytes / meas["peak"],
        step_seconds=[s["seconds"] for s in measured], losses=[s["loss"] for s in steps],
        max_memory_reserved_gib=(torch.cuda.max_memory_reserved() / GIB) if not cpu else None,
        baseline_gib=base / GIB,
    )
    res["params_match"] = res["params_built"] == res["params_local"]
    res["within_tol"] = abs(res["ratio"] - 1) <= a.tol
    M.release(ddp)
    del ddp, opt, batch, meter, steps, measured
    M.free_all()
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the logic)")
    ap.add_argument("--seq", type=int, default=None, help="tokens (default 32768; smoke 256)")
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--impl", default="fused", help="loss impl (fused falls back to chunked without CUDA)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tol", type=float, default=0.10)
    ap.add_argument("--only", nargs="*", help="config names to run")
    a = ap.parse_args(argv)
    if a.seq is None:
        a.seq = 256 if a.smoke else 32768
    if a.smoke:
        a.topk = min(a.topk, 16)
    M.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    results = dict(env=env_record(), args=vars(a), world=world, results=[], errors=[])
    t0 = time.time()
    for c in configs(world, a.smoke):
        if a.only and c["name"] not in a.only:
            continue
        try:
            r = run_one(c, a, world, rank)
            results["results"].append(r)
            if rank == 0:
                print(f"[{c['name']}] measured {r['measured_gib']['peak']:.2f} GiB, predicted "
                      f"{r['predicted_gib']['peak']:.2f} GiB ({r['predicted_phase']}), ratio {r['ratio']:.3f}, "
                      f"params built {r['params_built']} vs plan {r['params_local']}, "
                      f"step {min(r['step_seconds']):.2f} s", flush=True)
        except Exception as e:  # an OOM is a result too
            oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()
            results["errors"].append(dict(name=c["name"], rank=rank, oom=oom, error=repr(e)[:2000],
                                          traceback=traceback.format_exc()[-4000:]))
            print(f"[{c['name']}] FAILED: {e!r}"[:1000], flush=True)
            M.free_all()
    results["seconds"] = time.time() - t0
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    ok = all(r["within_tol"] and r["params_match"] for g in gathered for r in g["results"]) and \
        not any(g["errors"] for g in gathered)
    if rank == 0:
        out = gathered[0] | dict(ranks=gathered, all_within_tol=ok)
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        import json
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {a.out}; all within {a.tol:.0%}: {ok}; {results['seconds']:.0f} s")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def env_record():
    try:
        from common import environment
        return environment()
    except Exception as e:  # noqa: BLE001
        return dict(error=repr(e))


if __name__ == "__main__":
    sys.exit(main())
