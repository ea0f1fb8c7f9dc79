"""Run a function on N gloo ranks (real process groups) and surface any rank's failure (or a hang, with a timeout)."""
import faulthandler
import os
import socket
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, errq, deadline=None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if deadline:  # every thread's stack on stderr just before the parent gives up: where each rank waits
        faulthandler.dump_traceback_later(max(1.0, deadline - time.time() - 5))
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


def run_ranks(world: int, fn, *args, timeout: float | None = None) -> None:
    """fn(rank, world, *args) on `world` gloo ranks. timeout: seconds for all of them to finish; past it every rank
    is killed (after dumping its stacks to stderr) and the call fails, so a hang fails a test instead of blocking."""
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        wall = None if timeout is None else time.time() + timeout
        procs = mp.start_processes(_worker, args=(world, free_port(), fn, args, errq, wall), nprocs=world,
                                   start_method="spawn", join=False)
        while not procs.join(None if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                for p in procs.processes:
                    if p.is_alive():
                        p.kill()
                for p in procs.processes:
                    p.join()
                raise AssertionError(f"{world} ranks did not finish within {timeout:g} s (a rank waits in a "
                                     "collective its peers never join?); their stacks are on stderr")
    except Exception as e:
        msgs = []
        while not errq.empty():
            r, tb = errq.get()
            msgs.append(f"--- rank {r} ---\n{tb}")
        raise AssertionError("\n".join(msgs) or str(e)) from None
