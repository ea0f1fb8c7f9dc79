"""Memory planning: exact parameter counts and per-GPU peak memory of a KD training layout.

    from megatron_kd.plan import preset, Layout, Training, plan_memory
    p = plan_memory(preset("gpt-oss-20b"), Layout(tp=1, ep=8, dp=8), Training(seq_len=32768))
    p.peak_gib, p.peak_phase, p.items

`megatron-kd plan RECIPE_OR_SHAPE [--tp --ep --pp --cp --dp --seq --recompute --online ...]` prints it.
"""
from .memory import GIB, GPU_KINDS, H100_GIB, H200_GIB, RESERVE_GIB, Plan, Training, layer_activations, loss_buffers, plan_memory
from .shapes import PRESETS, Layout, ModelShape, active_params, param_counts, preset, total_params

__all__ = ["GIB", "GPU_KINDS", "H100_GIB", "H200_GIB", "RESERVE_GIB", "Plan", "Training", "layer_activations", "loss_buffers", "plan_memory",
           "PRESETS", "Layout", "ModelShape", "active_params", "param_counts", "preset",
           "total_params"]
