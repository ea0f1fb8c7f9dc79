"""Tensor-parallel loss benchmark: TP=1 (one GPU) vs TP=2 (two GPUs, NCCL), same run.

  torchrun --nproc_per_node 2 benchmarks/loss_tp_bench.py --out R.json

Rows: TP=1 on rank 0; TP=2; TP=2 with sequence parallel; TP=2 with the collectives replaced by no-ops
(same arithmetic, wrong numbers) so the difference to TP=2 is what communication costs.
"""
import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import environment, measure, save, synthetic_teacher  # noqa: E402

from megatron_kd import topk_kl_loss  # noqa: E402


@contextlib.contextmanager
def no_collectives():
    """Every all_reduce becomes a no-op (looked up at call time by megatron_kd.parallel.comm)."""
    saved = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: None
    try:
        yield
    finally:
        dist.all_reduce = saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=201088)
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--impls", nargs="+", default=["chunked", "forward_chunked", "fused"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    from megatron_kd.kernels import fused_available
    impls = [i for i in a.impls if i != "fused" or fused_available()]
    n, V, H = a.tokens, a.vocab, a.hidden
    torch.manual_seed(0)
    h_full = (torch.randn(n, H, device=dev) * 0.5).to(torch.bfloat16)
    w_full = (torch.randn(V, H, device=dev) * 0.02).to(torch.bfloat16)
    ids, logp = synthetic_teacher(n, a.topk, V, dev)
    vl = V // world
    rows = []

    def run_case(name, h, w, **kw):
        h = h.detach().clone().requires_grad_(True)
        w = w.detach().clone().requires_grad_(True)

        def step():
            h.grad = w.grad = None
            topk_kl_loss(h, w, ids, logp, **kw).backward()
        dist.barrier()
        r = measure(step)
        r.update(variant=name, rank=rank, tokens=n, vocab=V, hidden=H, topk=a.topk)
        gathered = [None] * world
        dist.all_gather_object(gathered, r)
        if rank == 0:
            rows.extend(gathered)
            print(name, [(g["rank"], round(g["ms"], 1), round(g["peak_gib"], 2), round(g["above_inputs_gib"], 2))
                         for g in gathered], flush=True)
        del h, w
        torch.cuda.empty_cache()

    for impl in impls:
        if rank == 0:  # TP=1 reference on one GPU
            h = h_full.detach().clone().requires_grad_(True)
            w = w_full.detach().clone().requires_grad_(True)

            def step():
                h.grad = w.grad = None
                topk_kl_loss(h, w, ids, logp, impl=impl).backward()
            r = measure(step)
            r.update(variant=f"{impl} TP=1", rank=0, tokens=n, vocab=V, hidden=H, topk=a.topk)
            rows.append(r)
            print(r["variant"], round(r["ms"], 1), round(r["peak_gib"], 2), round(r["above_inputs_gib"], 2), flush=True)
            del h, w
            torch.cuda.empty_cache()
        dist.barrier()
        shard = w_full[rank * vl:(rank + 1) * vl]
        g = dist.group.WORLD
        run_case(f"{impl} TP={world}", h_full, shard, impl=impl, tp_group=g)
        with no_collectives():
            run_case(f"{impl} TP={world} collectives removed", h_full, shard, impl=impl, tp_group=g)
        hs = h_full[rank * (n // world):(rank + 1) * (n // world)]
        run_case(f"{impl} TP={world} sequence parallel", hs, shard, impl=impl, tp_group=g, sequence_parallel=True)
    if rank == 0:
        save(a.out, dict(env=environment(), args=vars(a), world=world, rows=rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
