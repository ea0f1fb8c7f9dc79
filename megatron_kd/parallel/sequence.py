"""Sequence-parallel gather along dim 0 (backward: reduce-scatter), as an autograd Function.

Own small versions rather than megatron.core.tensor_parallel.mappings so the loss works on any
torch.distributed group (gloo included) without Megatron's CUDA-bound buffers.
"""
import torch
import torch.distributed as dist

from .comm import group_rank, group_size


def _all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    tp = group_size(group)
    if tp == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * tp,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    tp = group_size(group)
    if tp == 1:
        return x
    x = x.contiguous()
    n = x.shape[0] // tp
    if dist.get_backend(group) == "gloo":  # gloo has no reduce_scatter
        dist.all_reduce(x, group=group)
        return x[group_rank(group) * n:(group_rank(group) + 1) * n].clone()
    out = torch.empty((n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        # Each rank holds a partial (vocab-shard) gradient of the full sequence: sum, then keep our slice.
        return _reduce_scatter_dim0(grad, ctx.group), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[s/tp, ...] shard -> [s, ...]; backward reduce-scatters the (partial) gradient."""
    return _GatherSequence.apply(x, group)

