"""Run a function on N gloo ranks (real process groups) and surface any rank's failure."""
import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, errq):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        dist.barrier()  # every rank done before any tears gloo down (a rank destroyed early aborted its peer once)
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args) -> None:
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(world, free_port(), fn, args, errq), nprocs=world, start_method="spawn")
    except Exception as e:
        msgs = []
        while not errq.empty():
            r, tb = errq.get()
            msgs.append(f"--- rank {r} ---\n{tb}")
        raise AssertionError("\n".join(msgs) or str(e)) from None
