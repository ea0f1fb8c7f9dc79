"""Statistics measured at build time against the fp32 top-K values: covered mass and encoding error.

kl_error of a position = |sum_k p'_k (log p'_k - log p_k)|, p = fp32 teacher top-K probabilities, p' = the
decoded ones: the change of the top-K KL loss (tail "none") that a student equal to the teacher would see.

An encoding that keeps fewer than K entries (topp) adds: the kept count per position (its histogram, kept_hist[k - 1]
= positions keeping k), and the dropped mass d = mass of the K entries - mass of the kept ones (sum, max). Dropping
entries of mass d changes the tail-"none" loss's gradient with respect to the student's logits by at most 2 d in
L1 norm, for any student (the dropped ids lose their -p terms, and the kept mass m multiplying the student's
softmax drops by d); the covered mass and kl_error are then those of the kept entries.
"""
import numpy as np

MASS_BINS = 20


def empty_stats() -> dict:
    return {"tokens": 0, "mass_sum": 0.0, "mass_hist": [0] * MASS_BINS, "kl_error_sum": 0.0, "kl_error_max": 0.0}


def _by_id(ids, logp):
    order = np.argsort(ids, axis=1, kind="stable")
    return np.take_along_axis(ids, order, 1), np.take_along_axis(logp, order, 1).astype(np.float64)


def kl_error(ids, logp, dec_ids, dec_logp) -> np.ndarray:
    """Per position |sum p' (log p' - log p)| over matching ids; empty slots (-1) count as p = 0."""
    a_ids, a = _by_id(np.asarray(ids), np.asarray(logp))
    b_ids, b = _by_id(np.asarray(dec_ids), np.asarray(dec_logp))
    if not np.array_equal(a_ids, b_ids):
        raise AssertionError("decoded ids differ from the encoded ids: the encoding is broken")
    live = a_ids >= 0
    pb = np.where(live, np.exp(np.where(live, b, 0.0)), 0.0)
    return np.abs((pb * np.where(live, b - np.where(live, a, 0.0), 0.0)).sum(axis=1))


def _mass(ids, logp) -> np.ndarray:
    live = np.asarray(ids) >= 0
    return np.where(live, np.exp(np.where(live, np.asarray(logp, np.float64), 0.0)), 0.0).sum(axis=1)


def sample_stats(ids, logp, dec_ids, dec_lp, select=None) -> dict:
    """select: the encoding's choice of entries (encoding.select) when it keeps fewer than K, else None."""
    extra = {}
    if select is not None:
        full = _mass(ids, logp)
        ids, logp = select(ids, logp)
        kept = (np.asarray(ids) >= 0).sum(axis=1)
        dropped = np.maximum(full - _mass(ids, logp), 0.0)
        extra = {"kept_sum": int(kept.sum()), "kept_hist": [int(x) for x in np.bincount(kept - 1,
                                                                                          minlength=ids.shape[1])],
                 "dropped_sum": float(dropped.sum()), "dropped_max": float(dropped.max(initial=0.0))}
    return of_rows(*row_stats(ids, logp, dec_ids, dec_lp), extra)


def row_stats(ids, logp, dec_ids, dec_lp):
    """(covered mass, kl_error) of each position: computed row by row, so rows may be measured in chunks and
    concatenated before of_rows."""
    live = np.asarray(ids) >= 0
    mass = np.where(live, np.exp(np.where(live, np.asarray(logp, np.float64), 0.0)), 0.0).sum(axis=1)
    return mass, kl_error(ids, logp, dec_ids, dec_lp)


def of_rows(mass, err, extra=None) -> dict:
    """A sample's statistics from its positions' mass and kl_error (all of them, in order)."""
    hist = np.histogram(np.clip(mass, 0.0, 1.0), bins=MASS_BINS, range=(0.0, 1.0))[0]
    return {"tokens": int(mass.size), "mass_sum": float(mass.sum()), "mass_hist": [int(x) for x in hist],
            "kl_error_sum": float(err.sum()), "kl_error_max": float(err.max(initial=0.0)), **(extra or {})}


def merge(a: dict, b: dict) -> dict:
    out = {"tokens": a["tokens"] + b["tokens"], "mass_sum": a["mass_sum"] + b["mass_sum"],
           "mass_hist": [x + y for x, y in zip(a["mass_hist"], b["mass_hist"])],
           "kl_error_sum": a["kl_error_sum"] + b["kl_error_sum"],
           "kl_error_max": max(a["kl_error_max"], b["kl_error_max"])}
    if "kept_sum" in a or "kept_sum" in b:  # a top-P cache; an empty side (no samples yet) counts as zeros
        z = {"kept_sum": 0, "kept_hist": [], "dropped_sum": 0.0, "dropped_max": 0.0}
        a, b = {**z, **a}, {**z, **b}
        n = max(len(a["kept_hist"]), len(b["kept_hist"]))
        pad = lambda h: list(h) + [0] * (n - len(h))  # noqa: E731
        out.update(kept_sum=a["kept_sum"] + b["kept_sum"],
                   kept_hist=[x + y for x, y in zip(pad(a["kept_hist"]), pad(b["kept_hist"]))],
                   dropped_sum=a["dropped_sum"] + b["dropped_sum"], dropped_max=max(a["dropped_max"], b["dropped_max"]))
    return out


def summary(s: dict) -> dict:
    n = max(1, s["tokens"])
    hist = s["mass_hist"]
    cum, quantiles = 0, {}
    for q in (0.1, 0.5, 0.9):
        cum = 0
        for i, c in enumerate(hist):
            cum += c
            if cum >= q * s["tokens"]:
                quantiles[f"p{int(q * 100)}"] = (i + 1) / MASS_BINS  # upper edge of the bin
                break
    return {"tokens": s["tokens"], "mean_mass_covered": s["mass_sum"] / n,
            "mass_covered_quantiles_upper_bound": quantiles,
            "mass_covered_histogram": {f"{i / MASS_BINS:.2f}-{(i + 1) / MASS_BINS:.2f}": c for i, c in enumerate(hist)},
            "kl_error_mean": s["kl_error_sum"] / n, "kl_error_max": s["kl_error_max"], **_kept_summary(s, n)}


def kept_quantile(hist, q: float) -> int:
    """The smallest k with at least a fraction q of the positions keeping <= k entries (hist[k - 1]: count)."""
    total, cum = sum(hist), 0
    for i, c in enumerate(hist):
        cum += c
        if cum >= q * total:
            return i + 1
    return len(hist)


def _kept_summary(s: dict, n: int) -> dict:
    if "kept_sum" not in s:
        return {}
    h = s["kept_hist"]
    return {"kept_k_mean": s["kept_sum"] / n,
            "kept_k_quantiles": {f"p{int(q * 100)}": kept_quantile(h, q) for q in (0.1, 0.5, 0.9, 0.99)},
            "kept_k_histogram": {str(i + 1): c for i, c in enumerate(h) if c},
            "dropped_mass_mean": s["dropped_sum"] / n, "dropped_mass_max": s["dropped_max"],
            "grad_error_bound_mean": 2 * s["dropped_sum"] / n}
