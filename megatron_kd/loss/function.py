"""The autograd Function behind the dense, chunked and forward_chunked impls.

They differ only in what forward keeps for backward:
  dense           - the whole logit matrix [N, Vs];
  chunked         - per-position statistics, logits recomputed chunk by chunk in backward;
  forward_chunked - finished gradients, computed chunk by chunk during forward (no recompute GEMM).
"""
import torch

from ..parallel.comm import all_reduce_sum
from ..kernels import gemm
from .core import ChunkStats, chunk_grad, chunk_loss, chunk_monitor, chunk_stats


def row_weights(t, opts):
    """Per-position factor turning unweighted losses into the reduced loss (grad_output = 1)."""
    if opts.reduction == "mean":
        total = t.weight.sum()
        return torch.where(total > 0, t.weight / total.clamp_min(torch.finfo(t.weight.dtype).tiny),
                           torch.zeros_like(t.weight))
    if opts.reduction == "sum":
        return t.weight
    return (t.weight > 0).to(t.weight.dtype)


def reduce(per_pos, t, opts):
    if opts.reduction == "none":
        return torch.where(t.weight > 0, per_pos, torch.zeros_like(per_pos))
    return (per_pos * row_weights(t, opts)).sum()


class TopKKLFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, t, opts, shard, mode, chunk, reduce_grad_input, metrics=None):
        mdt = t.logp.dtype
        n = hidden.shape[0]
        w = weight[: shard.local_valid]
        g = row_weights(t, opts)
        per_pos, stats, saved_z, monitor = [], [], [], []
        grad_h = grad_w = None
        if mode == "forward_chunked":
            grad_h = torch.empty((n, hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
            grad_w = torch.zeros((weight.shape[0], weight.shape[1]), dtype=mdt, device=weight.device)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            tc = t.slice(a, b)
            z = gemm.mm(hidden[a:b], w.t(), mdt)
            st = chunk_stats(z, tc, opts, shard)
            per_pos.append(chunk_loss(st, tc, opts))
            if opts.monitor:
                monitor.append(chunk_monitor(st, tc))
            if mode == "dense":
                saved_z.append(z)
                stats.append(st)
            elif mode == "chunked":
                stats.append(st)
            else:
                dz = chunk_grad(z, st, tc, opts, shard, g[a:b])
                grad_h[a:b] = gemm.mm(dz.to(w.dtype), w, dz.dtype)
                gemm.addmm_(grad_w[: shard.local_valid], dz.to(hidden.dtype).t(), hidden[a:b])
            del z
        per_pos = torch.cat(per_pos) if per_pos else torch.zeros(0, dtype=mdt, device=hidden.device)
        out = reduce(per_pos, t, opts)
        if opts.monitor and metrics is not None:
            metrics["kl_bucket"] = reduce(torch.cat(monitor) if monitor else torch.zeros_like(per_pos), t, opts)

        ctx.mode, ctx.chunk, ctx.opts, ctx.shard, ctx.t = mode, chunk, opts, shard, t
        ctx.reduce_grad_input, ctx.weight_dtype = reduce_grad_input, weight.dtype
        if mode == "forward_chunked":
            if reduce_grad_input:
                all_reduce_sum(grad_h, shard.group)
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        else:
            ctx.stats = ChunkStats.cat(stats) if stats else None
            ctx.saved_z = saved_z
            ctx.save_for_backward(hidden, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        opts, shard, t = ctx.opts, ctx.shard, ctx.t
        if ctx.mode == "forward_chunked":
            grad_h, grad_w = ctx.saved_tensors
            s = grad_out.to(grad_h.dtype)
            return (grad_h * s, grad_w * grad_out.to(grad_w.dtype)) + (None,) * (len(ctx.needs_input_grad) - 2)
        hidden, weight = ctx.saved_tensors
        w = weight[: shard.local_valid]
        mdt = t.logp.dtype
        if opts.reduction == "none":
            g = grad_out.reshape(-1).to(mdt) * (t.weight > 0).to(mdt)
        else:
            g = row_weights(t, opts) * grad_out.to(mdt)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=mdt, device=weight.device)
        for i, a in enumerate(range(0, hidden.shape[0], ctx.chunk)):
            b = min(hidden.shape[0], a + ctx.chunk)
            # dense copies its saved logits so backward can run twice (retain_graph, gradcheck)
            z = ctx.saved_z[i].clone() if ctx.mode == "dense" else gemm.mm(hidden[a:b], w.t(), mdt)
            dz = chunk_grad(z, ctx.stats.select(a, b), t.slice(a, b), opts, shard, g[a:b])
            grad_h[a:b] = gemm.mm(dz.to(w.dtype), w, dz.dtype)
            gemm.addmm_(grad_w[: shard.local_valid], dz.to(hidden.dtype).t(), hidden[a:b])
            del z, dz
        if ctx.reduce_grad_input:
            all_reduce_sum(grad_h, shard.group)
        return (grad_h, grad_w.to(ctx.weight_dtype)) + (None,) * (len(ctx.needs_input_grad) - 2)
