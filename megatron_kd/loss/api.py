"""The public entry points: kd_loss (options as objects) and topk_kl_loss (its keyword form)."""
from dataclasses import replace

import torch

from ..parallel.comm import group_size
from ..parallel.sequence import gather_sequence
from ..parallel.vocab import VocabLayout
from .chunks import FusedSettings, default_chunk_size
from .function import TopKKLFunction
from .inputs import check_and_flatten
from .options import LossOptions
from .temper import retemper_logprobs

DENSE_AUTO_LIMIT = 1 << 24  # "auto" on CPU materializes logits below this many elements


def _pick_impl(opts: LossOptions, n: int, v_local: int, device: torch.device) -> str:
    """v_local must be the same on every TP rank (the ranks run matching collectives)."""
    if opts.impl != "auto":
        return opts.impl
    if device.type == "cuda":
        from ..kernels import fused_available
        if fused_available():
            return "fused"
    if n * v_local <= DENSE_AUTO_LIMIT:
        return "dense"
    return "chunked" if opts.reduction == "none" else "forward_chunked"


def _check_call_extras(grad_scale, fused_settings, metrics, weight) -> float:
    """The arguments topk_kl_loss checks itself (LossOptions and check_and_flatten check the rest)."""
    grad_scale = float(grad_scale)
    if not (grad_scale > 0 and grad_scale < float("inf")):
        raise ValueError(f"grad_scale={grad_scale} must be a finite positive number (the expected grad_output)")
    if fused_settings is not None and not isinstance(fused_settings, FusedSettings):
        raise ValueError(f"fused_settings must be a megatron_kd.loss.FusedSettings or None, got "
                         f"{type(fused_settings).__name__}")
    if metrics is not None and not isinstance(metrics, dict):
        raise ValueError(f"metrics must be a dict to fill (or None), got {type(metrics).__name__}")
    if not torch.is_tensor(weight) or weight.dim() != 2:
        raise ValueError(f"weight must be [V, H] (this rank's vocab shard), got shape "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    return grad_scale


def _run_impl(mode, h, weight, t, opts, shard, reduce_grad_input, fused_settings, grad_scale, metrics):
    """The loss of impl `mode` over the flattened inputs (the fused impl, or the autograd Function of the torch impls)."""
    if mode == "fused":
        from ..kernels import fused_unavailable
        problem = fused_unavailable(h.device.type == "cuda")
        if problem:
            raise ValueError(f'impl="fused" {problem}; use impl="auto" (fused where it runs, else chunked)')
        from .fused import fused_topk_kl
        out = fused_topk_kl(h, weight, t, opts, shard, reduce_grad_input=reduce_grad_input,
                            settings=fused_settings, grad_scale=grad_scale, metrics=metrics)
    else:
        if mode == "forward_chunked" and opts.reduction == "none":
            mode = "chunked"  # per-position upstream grads are unknown in forward
        n = max(1, h.shape[0])
        # chunk tokens follow the global vocabulary, so a TP rank's chunk buffer shrinks with its shard
        chunk = n if mode == "dense" else int(opts.chunk_size or default_chunk_size(shard.valid_size))
        out = TopKKLFunction.apply(h, weight, t, opts, shard, mode, chunk, reduce_grad_input, metrics)
    return out


def kd_loss(hidden, weight, topk_ids, topk_logprobs, opts: LossOptions, layout: VocabLayout = VocabLayout(), *,
            labels=None, loss_mask=None, fused_settings=None, grad_scale=1.0, metrics=None):
    """topk_kl_loss with its options as objects, built once by the caller: opts (LossOptions: the divergence,
    temperature, weights, tail, reduction and impl) and layout (VocabLayout: how the vocabulary and the sequence
    are split over ranks). Arguments, shapes and the result as in topk_kl_loss; opts.monitor follows metrics."""
    grad_scale = _check_call_extras(grad_scale, fused_settings, metrics, weight)
    if not isinstance(opts, LossOptions):
        raise ValueError(f"opts must be a megatron_kd.loss.LossOptions (KDLoss.loss_options() makes one), got "
                         f"{type(opts).__name__}")
    if not isinstance(layout, VocabLayout):
        raise ValueError(f"layout must be a megatron_kd.parallel.VocabLayout, got {type(layout).__name__}")
    if opts.monitor != (metrics is not None):
        opts = replace(opts, monitor=metrics is not None)
    return _loss(hidden, weight, topk_ids, topk_logprobs, opts, layout, labels, loss_mask, fused_settings,
                 grad_scale, metrics)


def _loss(hidden, weight, topk_ids, topk_logprobs, opts, layout, labels, loss_mask, fused_settings, grad_scale,
          metrics):
    """The loss of checked options: flatten and check the tensors, re-temper, gather the sequence, run the impl."""
    shard = layout.shard(weight.shape[0])
    seq_shards = layout.seq_shards
    h, t, lead = check_and_flatten(hidden, weight, topk_ids, topk_logprobs, labels, loss_mask, opts,
                                   vocab_size=shard.valid_size, seq_shards=seq_shards)
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if opts.retemper is not None:
        t.logp = retemper_logprobs(t.logp, t.valid, opts.retemper)
    if seq_shards > 1:
        h = gather_sequence(hidden, layout.tp_group).reshape(-1, hidden.shape[-1])
    tp = group_size(layout.tp_group)
    mode = _pick_impl(opts, h.shape[0], -(-shard.valid_size // tp), h.device)
    out = _run_impl(mode, h, weight, t, opts, shard, seq_shards == 1, fused_settings, grad_scale, metrics)
    if opts.reduction == "none":
        if metrics is not None and "kl_bucket" in metrics:
            metrics["kl_bucket"] = metrics["kl_bucket"].reshape(lead)
        return out.reshape(lead)
    return out


def topk_kl_loss(hidden, weight, topk_ids, topk_logprobs, *, labels=None, loss_mask=None, kl_weight=1.0,
                 ce_weight=0.0, temperature=1.0, tail="none", reduction="mean", impl="auto", chunk_size=None,
                 ignore_index=-100, tp_group=None, sequence_parallel=False, vocab_start_index=None,
                 valid_vocab_size=None, fused_settings=None, grad_scale=1.0, divergence="forward_kl", jsd_beta=0.5,
                 cache_temperature=None, metrics=None):
    """A divergence between a sparse top-K teacher and the student, from the student's hidden states, never
    holding [N, V] logits. The keyword form of kd_loss: the options and the layout are made into their objects
    here (a caller that makes many calls builds them once and calls kd_loss).

    hidden [..., H] (under sequence_parallel: this rank's [s/tp, ...] shard), weight [V_local, H] (this
    rank's vocab shard), topk_ids / topk_logprobs [..., K] (global ids, -1 = empty; teacher log-probs over
    its full vocabulary), labels / loss_mask [...]. Returns a scalar ("mean", "sum") or [...] ("none").

    Per position: loss = T^2 * kl_weight * D(teacher, softmax(z / T)) + ce_weight * CE(softmax(z), label).
    T^2 is included (ModelOpt's Megatron plugin and Liger leave it out: pass kl_weight=1/T**2 for their number).
    Only the student is tempered: topk_logprobs must be the teacher's log-softmax at T, or were captured at
    cache_temperature=T0 and are re-tempered here over the K ids plus one rest class (an approximation:
    docs/loss.md gives its measured error). divergence: "forward_kl" KL(t || s), "reverse_kl" KL(s || t), "jsd"
    beta KL(t || m) + (1 - beta) KL(s || m), m = beta t + (1 - beta) s, beta = jsd_beta in (0, 1). tail: what
    the K ids are compared as: "none" the K ids as they are (forward KL can go below 0), "renormalize" both
    renormalized over the K ids, "bucket" the K ids plus one class for the rest of the vocabulary.
    reduction: "mean" sum(w loss) / sum(w), w = loss_mask x (labels != ignore_index); "sum" sum(w loss); "none"
    per position (0 where w = 0). metrics: a dict to fill with "kl_bucket", the bucket-tail KL(t || s) at T (no
    T^2, detached, same reduction), a true divergence to monitor. Full definitions: docs/loss.md.
    tp_group, sequence_parallel, vocab_start_index, valid_vocab_size: the vocab-parallel layout (VocabLayout).
    fused_settings: FusedSettings for impl="fused" (None: the production defaults; loss/chunks.py).
    grad_scale: the grad_output backward will bring (Megatron: the optimizer's loss scale, megatron.optim.loss_scale).
    impl="fused" writes the weight gradient into weight.main_grad during forward already times grad_scale; a
    different grad_output is still exact but reruns the whole loss in backward.
    """
    grad_scale = _check_call_extras(grad_scale, fused_settings, metrics, weight)
    opts = LossOptions(kl_weight=kl_weight, ce_weight=ce_weight, temperature=temperature, tail=tail,
                       reduction=reduction, impl=impl, chunk_size=chunk_size, ignore_index=ignore_index,
                       divergence=divergence, jsd_beta=jsd_beta, cache_temperature=cache_temperature,
                       monitor=metrics is not None)
    layout = VocabLayout(tp_group, bool(sequence_parallel), vocab_start_index, valid_vocab_size)
    return _loss(hidden, weight, topk_ids, topk_logprobs, opts, layout, labels, loss_mask, fused_settings,
                 grad_scale, metrics)
