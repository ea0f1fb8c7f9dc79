"""Collectives that are no-ops without a group, so TP=1 and TP>1 share one code path."""
import torch
import torch.distributed as dist


def group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) > 1:
        # -inf survives MAX on every backend; NaN would not, and is never produced here.
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t
