"""Check the user's tensors and flatten them to N positions.

Checks that need the values (id and label ranges, NaN / +inf / positive log-probs, non-finite or negative mask
entries) are reduced on the device into one small tensor and read with one host sync per call; they are worth
it, since an out-of-range id otherwise becomes a silent wrong gather or a device-side assert, and one NaN in a
mask zeroes the whole batch's gradient.
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


# A log-prob above this (at a non-empty slot) is not rounding of log(p <= 1): a corrupt cache or raw logits.
LOGPROB_TOLERANCE = 1e-3
# A position's top-K probabilities summing above 1 + this are no part of one distribution (an fp16 cache's
# rounding of a full-mass top-K stays far below it).
MASS_TOLERANCE = 1e-2


def math_dtype_for(hidden: torch.Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _check_devices(hidden, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and torch.is_tensor(t) and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device}, hidden on {hidden.device}: move every input of the loss to "
                             "one device")


def check_and_flatten(hidden, weight, topk_ids, topk_logprobs, labels, loss_mask, opts, vocab_size,
                      seq_shards: int = 1, repeated_ids_ok: bool = False) -> tuple[torch.Tensor, Targets, tuple]:
    """Returns (hidden [N_local, H], targets over all N positions, leading shape of the targets).
    At most one host sync (the value checks, gathered into one tensor). repeated_ids_ok: skip the refusal of one
    id in two slots of a position; the kernels merge such slots exactly, and their own tests feed them, while
    users' top-K lists (the public API) never hold one."""
    _check_hidden(hidden)
    _check_devices(hidden, weight=weight, topk_ids=topk_ids, topk_logprobs=topk_logprobs, labels=labels,
                   loss_mask=loss_mask)
    _check_weight(weight, hidden)
    _check_teacher_shapes(topk_ids, topk_logprobs)
    lead = _leading_shape(hidden, topk_ids, seq_shards)
    k = topk_ids.shape[-1]
    if k > vocab_size:
        raise ValueError(f"topk_ids has K={k} slots but the vocabulary has only V={vocab_size} ids")
    n = 1
    for d in lead:
        n *= d
    mdt = math_dtype_for(hidden)
    ids = topk_ids.reshape(n, k).long()
    raw = topk_logprobs.reshape(n, k).to(mdt)
    valid = (ids >= 0) & (raw > float("-inf"))  # a -inf log-prob carries no teacher mass: an empty slot
    logp = raw.masked_fill(~valid, 0.0)

    w = torch.ones(n, dtype=mdt, device=hidden.device)
    if loss_mask is not None:
        if tuple(loss_mask.shape) != lead:
            raise ValueError(f"loss_mask must have shape {lead}, got {tuple(loss_mask.shape)}")
        w = loss_mask.reshape(n).to(mdt)
    lab, counted = _flat_labels(labels, lead, n, opts)
    if n:
        _check_values(ids, raw, w if loss_mask is not None else None, lab, counted, opts, vocab_size,
                      repeated_ids_ok)
    if lab is not None:
        w = w * counted.to(mdt)
        lab = lab.masked_fill(~counted, -1)
    h = hidden.reshape(-1, hidden.shape[-1])
    return h, Targets(ids, logp, valid, lab, w), lead


def _check_hidden(hidden) -> None:
    if not torch.is_tensor(hidden) or hidden.dim() < 1:
        raise ValueError("hidden must be a tensor [..., H]")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")


def _check_weight(weight, hidden) -> None:
    if not torch.is_tensor(weight) or weight.dim() != 2:
        raise ValueError(f"weight must be [V, H], got shape {tuple(getattr(weight, 'shape', ()))}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight is [V, H] = {tuple(weight.shape)} but hidden's last dim is {hidden.shape[-1]}: "
                         "H must match (pass the output layer's weight, not its transpose)")


def _check_teacher_shapes(topk_ids, topk_logprobs) -> None:
    if not torch.is_tensor(topk_ids) or topk_ids.dim() < 1:
        raise ValueError("topk_ids must be a tensor [..., K]")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if not torch.is_tensor(topk_logprobs) or topk_logprobs.shape != topk_ids.shape:
        raise ValueError(f"topk_logprobs must have topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(getattr(topk_logprobs, 'shape', ()))}")


def _leading_shape(hidden, topk_ids, seq_shards: int) -> tuple:
    """topk_ids' leading shape; hidden's must be it, or this rank's sequence shard of it (sequence parallel)."""
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
    return lead


def _flat_labels(labels, lead: tuple, n: int, opts) -> tuple:
    """(labels [N] int64, counted [N] bool: not ignore_index), or (None, None) without labels."""
    if labels is None:
        if opts.needs_ce:
            raise ValueError("ce_weight != 0 needs labels")
        return None, None
    if tuple(labels.shape) != lead:
        raise ValueError(f"labels must have shape {lead}, got {tuple(labels.shape)}")
    if labels.is_floating_point():
        raise ValueError(f"labels must be integer, got {labels.dtype}")
    lab = labels.reshape(n).long()
    return lab, lab != opts.ignore_index


def _check_values(ids, raw, mask, lab, counted, opts, vocab_size, repeated_ids_ok: bool = False) -> None:
    """Every value check in one tensor, one host sync: the teacher's ids and log-probs (when K > 0), the loss mask
    (mask: None when not given) and the counted labels."""
    flags = {}
    if ids.shape[1]:
        real = ids >= 0
        held = real & (raw > float("-inf")) & ~torch.isnan(raw)
        ranked = ids.masked_fill(~held, -1).sort(dim=1).values
        flags.update(ids_lo=ids.min(), ids_hi=ids.max(), nan=(torch.isnan(raw) & real).any(),
                     positive=((raw > LOGPROB_TOLERANCE) & real).any(),
                     mass=torch.logsumexp(raw.masked_fill(~held, float("-inf")), dim=1).max().exp())
        if not repeated_ids_ok:
            flags["twice"] = ((ranked[:, 1:] == ranked[:, :-1]) & (ranked[:, 1:] >= 0)).any()
    if mask is not None:
        flags.update(nonfinite=(~torch.isfinite(mask)).any(), negative=(mask < 0).any())
    if lab is not None:
        shown = lab.masked_fill(~counted, 0)
        flags.update(lab_lo=shown.min(), lab_hi=shown.max())
    if not flags:
        return
    got = dict(zip(flags, torch.stack([f.double() for f in flags.values()]).tolist()))
    got = {k: v if k == "mass" else int(v) for k, v in got.items()}
    if "ids_lo" in got:
        _raise_teacher_problem(got["ids_lo"], got["ids_hi"], got["nan"], got["positive"], vocab_size)
        if got["mass"] > 1 + MASS_TOLERANCE:
            raise ValueError(f"topk_logprobs of one position sum to probability {got['mass']:.4g} > 1: they are no "
                             "part of one distribution; pass the top-K of log_softmax over the whole vocabulary, "
                             "or rebuild a corrupt cache")
        if got.get("twice"):
            raise ValueError("topk_ids holds one id twice within a position: a top-K lists each id once; mark a "
                             "repeated slot empty (id -1), or rebuild a corrupt cache")
    if "nonfinite" in got:
        if got["nonfinite"]:
            raise ValueError("loss_mask has NaN or inf entries: it must be finite and non-negative (0 = not "
                             "counted)")
        if got["negative"]:
            raise ValueError("loss_mask must be non-negative")
    if "lab_lo" in got:
        lo, hi = got["lab_lo"], got["lab_hi"]
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"labels must be in [0, {vocab_size - 1}] or ignore_index={opts.ignore_index}, "
                             f"found [{lo}, {hi}]")


def _raise_teacher_problem(lo, hi, nan, positive, vocab_size) -> None:
    if lo < -1 or hi >= vocab_size:
        raise ValueError(f"topk_ids must be in [-1, {vocab_size - 1}] (-1 = empty slot), found [{lo}, {hi}]; "
                         "was the cache built with another tokenizer or vocabulary?")
    if nan:
        raise ValueError("topk_logprobs has NaN at non-empty slots (ids >= 0): a corrupt cache or teacher "
                         "output; rebuild the cache, or mark those slots empty with id -1")
    if positive:
        raise ValueError(f"topk_logprobs has values > {LOGPROB_TOLERANCE:g} (+inf or positive) at non-empty "
                         "slots: log-probabilities are <= 0; pass log_softmax(logits / T), not logits, or "
                         "rebuild a corrupt cache")
