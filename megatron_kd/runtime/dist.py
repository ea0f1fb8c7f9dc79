"""Process group + Megatron parallel state setup, torchrun or single process, GPU (NCCL) or CPU (gloo)."""
import contextlib
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist

from .cpu_patches import apply_cpu_patches, megatron_compat, seed_model_parallel_rng


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_cuda(device: str = "auto") -> bool:
    if device == "cpu":
        return False
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no GPU is visible; use train.device=auto or cpu")
    return torch.cuda.is_available()


ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
PORT_TRIES = 5  # ports a single-process group tries when another process takes the one picked for it
DistNetworkError = getattr(dist, "DistNetworkError", RuntimeError)  # what the store raises on a taken port


def init_process_group(cuda: bool, *, launched_only: bool = False) -> bool:
    """Join (or create, for a plain `python`/single process) the default group; True if we created it.
    launched_only: join a launcher's group (WORLD_SIZE > 1) but run a single process without one."""
    if dist.is_initialized():
        return False
    if launched_only and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return False
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    made_up = os.environ["WORLD_SIZE"] == "1" and "MASTER_ADDR" not in os.environ
    if made_up:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        share_cpu_cores()
    for attempt in range(PORT_TRIES):
        try:
            dist.init_process_group("nccl" if cuda else "gloo", rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
            return True
        except DistNetworkError as e:
            # free_port() lets the port go before the group's store binds it: a process started beside this one
            # (runs side by side on one host) can take it in between. Only a port we made up may be replaced.
            if not made_up or attempt == PORT_TRIES - 1 or "EADDRINUSE" not in str(e):
                raise
            os.environ["MASTER_PORT"] = str(free_port())


def share_cpu_cores() -> None:
    """CPU ranks on one host split its cores (torchrun sets OMP_NUM_THREADS; a plain spawn does not): oversubscribed
    OpenMP pools spin against each other and run many times slower."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if local > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def init_model_parallel(p, cuda: bool) -> None:
    """Megatron's parallel groups for p, the recipe's parallel section (tp, pp, cp, ep, etp, vpp)."""
    from megatron.core import parallel_state as ps
    if not cuda:
        apply_cpu_patches()
    megatron_compat()  # MoE layers of megatron-core 0.16 without Transformer Engine
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                                 virtual_pipeline_model_parallel_size=p.vpp, context_parallel_size=p.cp,
                                 expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.etp)


def set_seed(seed: int) -> None:
    """Megatron-LM's rule: one seed per pipeline stage, then the model-parallel RNG tracker."""
    from megatron.core import parallel_state as ps
    s = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
    seed_model_parallel_rng(s)


@contextlib.contextmanager
def distributed(p, seed: int, device: str = "auto"):
    """Process group (if needed), Megatron groups and seeds for one job; torn down afterwards."""
    from megatron.core import parallel_state as ps
    cuda = use_cuda(device)
    env = {k: os.environ.get(k) for k in ENV_KEYS}
    created = init_process_group(cuda)
    try:
        init_model_parallel(p, cuda)
        set_seed(seed)
        yield cuda
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if created and dist.is_initialized():
            dist.destroy_process_group()
        if created:  # a single-process group we made up: leave the environment as we found it
            restore_env(env)


def restore_env(saved: dict) -> None:
    """Put environment variables back as `saved` ({name: value, None: unset}) holds them."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def is_rank0() -> bool:
    if dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0  # after the group is gone (torchrun still names the rank)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
