"""Check the user's tensors and flatten them to N positions.

Checks that need the values (id ranges) cost one small device sync; they are worth it, since an
out-of-range id otherwise becomes a silent wrong gather or a device-side assert.
"""
from dataclasses import dataclass

import torch


@dataclass
class Targets:
    """Per-position teacher and label data, flattened to N rows."""
    ids: torch.Tensor        # [N, K] int64 global ids, -1 for empty slots
    logp: torch.Tensor       # [N, K] math dtype, 0 in empty slots
    valid: torch.Tensor      # [N, K] bool
    labels: torch.Tensor | None  # [N] int64, -1 where not counted
    weight: torch.Tensor     # [N] math dtype, per-position weight (0 = not counted)

    def slice(self, a: int, b: int) -> "Targets":
        return Targets(self.ids[a:b], self.logp[a:b], self.valid[a:b],
                       None if self.labels is None else self.labels[a:b], self.weight[a:b])

    def take(self, rows: torch.Tensor) -> "Targets":
        return Targets(self.ids[rows], self.logp[rows], self.valid[rows],
                       None if self.labels is None else self.labels[rows], self.weight[rows])


def math_dtype_for(hidden: torch.Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def check_and_flatten(hidden, weight, topk_ids, topk_logprobs, labels, loss_mask, opts, vocab_size,
                      seq_shards: int = 1) -> tuple[torch.Tensor, Targets, tuple]:
    """Returns (hidden [N_local, H], targets over all N positions, leading shape of the targets)."""
    if not torch.is_tensor(hidden) or hidden.dim() < 1:
        raise ValueError("hidden must be a tensor [..., H]")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
    if not torch.is_tensor(weight) or weight.dim() != 2:
        raise ValueError(f"weight must be [V, H], got shape {tuple(getattr(weight, 'shape', ()))}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight is [V, H] = {tuple(weight.shape)} but hidden's last dim is {hidden.shape[-1]}: "
                         "H must match (pass the output layer's weight, not its transpose)")
    if not torch.is_tensor(topk_ids) or topk_ids.dim() < 1:
        raise ValueError("topk_ids must be a tensor [..., K]")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if not torch.is_tensor(topk_logprobs) or topk_logprobs.shape != topk_ids.shape:
        raise ValueError(f"topk_logprobs must have topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(getattr(topk_logprobs, 'shape', ()))}")
    lead = tuple(topk_ids.shape[:-1])
    hidden_lead = tuple(hidden.shape[:-1])
    expect_hidden = lead if seq_shards == 1 else (lead[0] // seq_shards,) + lead[1:] if lead else lead
    if seq_shards > 1 and (not lead or lead[0] % seq_shards):
        raise ValueError(f"sequence_parallel: the sequence dim of topk_ids ({lead[:1]}) must divide by the "
                         f"TP size {seq_shards}")
    if hidden_lead != expect_hidden:
        what = "this rank's sequence shard of " if seq_shards > 1 else ""
        raise ValueError(f"hidden's leading shape {hidden_lead} must be {what}topk_ids' leading shape {lead}"
                         f" (expected {expect_hidden})")
    k = topk_ids.shape[-1]
    if k > vocab_size:
        raise ValueError(f"topk_ids has K={k} slots but the vocabulary has only V={vocab_size} ids")
    n = 1
    for d in lead:
        n *= d
    mdt = math_dtype_for(hidden)
    ids = topk_ids.reshape(n, k).long()
    raw = topk_logprobs.reshape(n, k).to(mdt)
    if n and k:  # the three value checks share one host sync
        nan = (torch.isnan(raw) & (ids >= 0)).any()
        lo, hi, bad = torch.stack([ids.min(), ids.max(), nan.long()]).tolist()
        if lo < -1 or hi >= vocab_size:
            raise ValueError(f"topk_ids must be in [-1, {vocab_size - 1}] (-1 = empty slot), found [{lo}, {hi}]; "
                             "was the cache built with another tokenizer or vocabulary?")
        if bad:
            raise ValueError("topk_logprobs has NaN at non-empty slots (ids >= 0): a corrupt cache or teacher "
                             "output; rebuild the cache, or mark those slots empty with id -1")
    valid = (ids >= 0) & (raw > float("-inf"))  # a -inf log-prob carries no teacher mass: an empty slot
    logp = raw.masked_fill(~valid, 0.0)

    w = torch.ones(n, dtype=mdt, device=hidden.device)
    if loss_mask is not None:
        if tuple(loss_mask.shape) != lead:
            raise ValueError(f"loss_mask must have shape {lead}, got {tuple(loss_mask.shape)}")
        w = loss_mask.reshape(n).to(mdt)
        if n and bool((w < 0).any()):
            raise ValueError("loss_mask must be non-negative")
    lab = None
    if labels is not None:
        if tuple(labels.shape) != lead:
            raise ValueError(f"labels must have shape {lead}, got {tuple(labels.shape)}")
        if labels.is_floating_point():
            raise ValueError(f"labels must be integer, got {labels.dtype}")
        lab = labels.reshape(n).long()
        counted = lab != opts.ignore_index
        if n and counted.any():
            lo, hi = int(lab[counted].min()), int(lab[counted].max())
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"labels must be in [0, {vocab_size - 1}] or ignore_index={opts.ignore_index}, "
                                 f"found [{lo}, {hi}]")
        w = w * counted.to(mdt)
        lab = lab.masked_fill(~counted, -1)
    elif opts.needs_ce:
        raise ValueError("ce_weight != 0 needs labels")
    h = hidden.reshape(-1, hidden.shape[-1])
    return h, Targets(ids, logp, valid, lab, w), lead
