"""Top-P selection: per position the fewest of the K teacher entries whose probability mass reaches P.

A pure function of the [S, K] top-K ids and log-probs, so every TP, PP and DP layout that computes the same top-K
(parallel/topk.py makes it identical across layouts) keeps the same entries. Entries are first put in the cache's
canonical order (log-prob descending, ties: smaller id first) and the kept set is a prefix of that order:
- count = the smallest n with sum of the first n probabilities >= P (the sum in float64, in that order), at least
  min_k and at most the number of valid entries (id >= 0, log-prob > -inf); all of them when the K do not reach P;
- ties at the P boundary: entries of equal log-prob keep the canonical order, so the smaller id is kept. The count
  does not depend on which of the tied ids comes first (their probabilities are equal), and the order of the input
  columns does not matter.
"""
import numpy as np


def check_top_p(top_p, min_k, top_k) -> str | None:
    """None when (top_p, min_k) suit a cache of top_k entries, else what is wrong and the fix."""
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < float(top_p) <= 1.0:
        return f"top_p={top_p!r} must be a number in (0, 1] (e.g. 0.999: the fewest ids holding 99.9% of the mass)"
    if isinstance(min_k, bool) or not isinstance(min_k, (int, np.integer)) or not 1 <= int(min_k) <= int(top_k):
        return f"min_k={min_k!r} must be an integer in [1, top_k={top_k}]"
    return None


def canonical_order(ids, logp):
    """ids int64 [S, K] and log-probs [S, K] sorted by log-prob descending, ties by smaller id, empty slots
    (id -1 or log-prob -inf) last as id -1 / -inf."""
    ids = np.asarray(ids, dtype=np.int64)
    logp = np.asarray(logp, dtype=np.float32)
    empty = (ids < 0) | np.isneginf(logp)
    ids = np.where(empty, -1, ids)
    logp = np.where(empty, np.float32(-np.inf), logp)
    key_id = np.where(empty, np.iinfo(np.int64).max, ids)
    order = np.lexsort((key_id, -logp), axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(logp, order, -1)


def top_p_counts(logp_sorted, top_p: float, min_k: int = 1) -> np.ndarray:
    """Kept entries per position (int64 [S]) for log-probs in canonical order (empty slots -inf, last)."""
    lp = np.asarray(logp_sorted, dtype=np.float64)
    valid = (~np.isneginf(lp)).sum(axis=-1)
    cum = np.cumsum(np.exp(lp), axis=-1)  # sequential: the same rounding on every rank and run
    reached = cum >= float(top_p)
    n = np.where(reached.any(axis=-1), reached.argmax(axis=-1) + 1, valid)
    return np.minimum(np.maximum(n, int(min_k)), valid).astype(np.int64)


def select_top_p(ids, logp, top_p: float, min_k: int = 1):
    """(ids int64 [S, K], log-probs float32 [S, K], counts int64 [S]): the kept entries first in canonical order,
    then id -1 / log-prob -inf in the unused slots."""
    ids, logp = canonical_order(ids, logp)
    counts = top_p_counts(logp, top_p, min_k)
    drop = np.arange(ids.shape[-1]) >= counts[..., None]
    return np.where(drop, -1, ids), np.where(drop, np.float32(-np.inf), logp), counts
