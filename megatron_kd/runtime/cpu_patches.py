"""Patches that let megatron-core 0.16 run on CPU with gloo (tests, demo). No-ops with CUDA.

A: Megatron allocates its global memory buffer and gather buffers on torch.cuda.current_device().
B: its CUDA RNG tracker asserts without CUDA; the inference tracker falls back to the CPU RNG.
C: dist_checkpointing calls torch.cuda.synchronize() before writing; with nothing on a GPU it is a no-op.
megatron_compat (planner tests, benchmarks): MoE without TE on 0.16, full recompute without CUDA.
"""
import torch

_applied = False


def apply_cpu_patches() -> None:
    global _applied
    if _applied or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # megatron-core 0.19's DDP grad sync waits on torch.cuda.current_stream() events (none on CPU)
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    _applied = True


class _NoStream:
    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def seed_model_parallel_rng(seed: int) -> None:
    """Megatron's model-parallel RNG seeding, CPU-safe (patch B)."""
    from megatron.core import tensor_parallel
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def megatron_compat() -> None:
    """megatron-core 0.16 without TE: MoE's router references an undefined `te_general_gemm` (0.19 sets None).
    Without CUDA (CPU tests, smoke runs): full recompute's checkpoint saves/restores the CUDA RNG state; skip it."""
    try:
        from megatron.core.transformer.moe import moe_utils
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    except Exception:
        pass
    if not torch.cuda.is_available():
        from megatron.core.tensor_parallel import random as mrandom
        if hasattr(mrandom, "_get_cuda_rng_state"):
            mrandom._get_cuda_rng_state = lambda *a, **k: torch.zeros(1, dtype=torch.uint8)
        if hasattr(mrandom, "_set_cuda_rng_state"):
            mrandom._set_cuda_rng_state = lambda *a, **k: None
