"""The public entry point: topk_kl_loss."""
import torch

from ..parallel.comm import group_size
from ..parallel.sequence import gather_sequence
from ..parallel.vocab import VocabShard
from .chunks import FusedSettings, default_chunk_size
from .function import TopKKLFunction
from .inputs import check_and_flatten
from .options import LossOptions

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


def topk_kl_loss(hidden, weight, topk_ids, topk_logprobs, *, labels=None, loss_mask=None, kl_weight=1.0,
                 ce_weight=0.0, temperature=1.0, tail="none", reduction="mean", impl="auto", chunk_size=None,
                 ignore_index=-100, tp_group=None, sequence_parallel=False, vocab_start_index=None,
                 valid_vocab_size=None, fused_settings=None, grad_scale=1.0):
    """KL(teacher top-K || student) from the student's hidden states, never holding [N, V] logits.

    hidden [..., H] (under sequence_parallel: this rank's [s/tp, ...] shard), weight [V_local, H] (this
    rank's vocab shard), topk_ids / topk_logprobs [..., K] (global ids, -1 = empty; teacher log-probs over
    its full vocabulary), labels / loss_mask [...]. Returns a scalar ("mean", "sum") or [...] ("none").
    fused_settings: FusedSettings for impl="fused" (None: the production defaults; loss/chunks.py).
    grad_scale: the grad_output backward will bring (Megatron: the optimizer's loss scale, megatron.optim.loss_scale).
    impl="fused" writes the weight gradient into weight.main_grad during forward already times grad_scale; a
    different grad_output is still exact but reruns the whole loss in backward.
    """
    grad_scale = float(grad_scale)
    if not (grad_scale > 0 and grad_scale < float("inf")):
        raise ValueError(f"grad_scale={grad_scale} must be a finite positive number (the expected grad_output)")
    if fused_settings is not None and not isinstance(fused_settings, FusedSettings):
        raise ValueError(f"fused_settings must be a megatron_kd.loss.FusedSettings or None, got "
                         f"{type(fused_settings).__name__}")
    opts = LossOptions(kl_weight=float(kl_weight), ce_weight=float(ce_weight), temperature=float(temperature),
                       tail=tail, reduction=reduction, impl=impl, chunk_size=chunk_size, ignore_index=ignore_index)
    tp = group_size(tp_group)
    if sequence_parallel and tp == 1:
        sequence_parallel = False
    if not torch.is_tensor(weight) or weight.dim() != 2:
        raise ValueError(f"weight must be [V, H] (this rank's vocab shard), got shape "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    shard = VocabShard.build(weight.shape[0], tp_group, vocab_start_index, valid_vocab_size)
    h, t, lead = check_and_flatten(hidden, weight, topk_ids, topk_logprobs, labels, loss_mask, opts,
                                   vocab_size=shard.valid_size, seq_shards=tp if sequence_parallel else 1)
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if sequence_parallel:
        h = gather_sequence(hidden, tp_group).reshape(-1, hidden.shape[-1])
    mode = _pick_impl(opts, h.shape[0], -(-shard.valid_size // tp), h.device)
    if mode == "fused":
        from .fused import fused_topk_kl
        out = fused_topk_kl(h, weight, t, opts, shard, reduce_grad_input=not sequence_parallel,
                            settings=fused_settings, grad_scale=grad_scale)
    else:
        if mode == "forward_chunked" and opts.reduction == "none":
            mode = "chunked"  # per-position upstream grads are unknown in forward
        n = max(1, h.shape[0])
        # chunk tokens follow the global vocabulary, so a TP rank's chunk buffer shrinks with its shard
        chunk = n if mode == "dense" else int(opts.chunk_size or default_chunk_size(shard.valid_size))
        out = TopKKLFunction.apply(h, weight, t, opts, shard, mode, chunk, not sequence_parallel)
    return out.reshape(lead) if opts.reduction == "none" else out
