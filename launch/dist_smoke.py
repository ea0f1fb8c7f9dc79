"""Check a launch before a long job: every rank joins the process group and all-reduces its rank.

    launch/torchrun.sh launch/dist_smoke.py        # NCCL on GPUs, gloo on CPU

Rank 0 prints one line with the world size, backend and the sum; any rank exits non-zero on a mismatch.
"""
import os

import torch
import torch.distributed as dist


def main() -> int:
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    x = torch.tensor([float(rank)], device=device)
    dist.all_reduce(x)
    expected = world * (world - 1) / 2
    ok = float(x.item()) == expected
    if rank == 0:
        print(f"dist_smoke: world={world} backend={backend} sum={x.item():g} expected={expected:g} "
              f"{'OK' if ok else 'MISMATCH'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
