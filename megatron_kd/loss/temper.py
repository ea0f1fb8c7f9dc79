"""Re-tempering a sparse cache: train at temperature T from teacher log-probs captured at T0.

The cache holds log p0 (the teacher's log-probs at T0) on its top-K ids only. Re-tempering the full
distribution needs every logit: p_T(v) = softmax(z_v / T) = p0(v)^(T0/T) / sum_w p0(w)^(T0/T). From a cache we
only know the K probabilities and the rest mass R0 = 1 - sum p0, so the rest is treated as ONE class:

    p_T(i) = p0(i)^a / Z   for the K ids,   R_T = R0^a / Z,   Z = sum_i p0(i)^a + R0^a,   a = T0 / T.

This is exact on the ratios between the K ids (p_T(i) / p_T(j) = (p0(i) / p0(j))^a, as for the full
distribution); only the normalizer Z is approximate: the true one sums p0(v)^a over the individual rest ids,
sum_v p0(v)^a <= R0^a for a > 1 (sharpening, T < T0) and >= for a < 1 (softening). So the re-tempered top-K
mass is too low when sharpening and too high when softening; the error shrinks with R0 (docs/loss.md gives
the measured error on the demo teacher; benchmarks/offline_vs_online.py measures it).
"""
import torch

from .core import _rest_mass


def retemper_logprobs(logp: torch.Tensor, valid: torch.Tensor, ratio: float) -> torch.Tensor:
    """logp [N, K] (0 at invalid slots), valid [N, K]; returns the log-probs at T = T0 / ratio (0 at invalid
    slots), normalized over the K ids plus the rest class."""
    a = float(ratio)
    p = torch.exp(logp) * valid
    R0 = _rest_mass(p.sum(dim=1))
    scaled = (a * logp).masked_fill(~valid, float("-inf"))
    rest = torch.where(R0 > 0, a * torch.log(R0), torch.full_like(R0, float("-inf")))
    log_z = torch.logsumexp(torch.cat([scaled, rest[:, None]], dim=1), dim=1)
    log_z = torch.where(torch.isfinite(log_z), log_z, torch.zeros_like(log_z))  # a row with nothing in it
    return (scaled - log_z[:, None]).masked_fill(~valid, 0.0)
