"""Shared by the top-K tests: the float64 reference rule, the package's whole-row (exact) path, and the package
with its block prefilter turned off."""
import numpy as np
import torch

from megatron_kd.parallel import topk as topk_ops
from megatron_kd.parallel.vocab import VocabShard


def exact(x, k, temperature=1.0, valid=None):
    """The whole-row key rule for every row (the reference path of topk.py, one chunk)."""
    shard = VocabShard.build(x.shape[1], None, None, valid)
    ids, lp, _ = topk_ops._chunk(x, k, shard, None, temperature, exact=True)
    return ids, lp


def reference(x, k, temperature=1.0, valid=None):
    """float64: ids by (value desc, id asc) of float32(x) / T, log-probs against the fp64 log-sum-exp."""
    u = (x.float() / temperature if temperature != 1.0 else x.float()).double().numpy()
    if valid is not None:
        u = u[:, :valid]
    ids = np.stack([np.lexsort((np.arange(r.size), -r))[:k] for r in u])
    m = u.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(u - m).sum(axis=1))
    return torch.from_numpy(ids), torch.from_numpy(np.take_along_axis(u, ids, 1) - lse[:, None])


def plain(fn, *args, **kw):
    """fn with the prefilter off: the path every row took before it."""
    saved = topk_ops._blocks_pay
    topk_ops._blocks_pay = lambda width, kk: False
    try:
        return fn(*args, **kw)
    finally:
        topk_ops._blocks_pay = saved
