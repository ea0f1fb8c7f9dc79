"""A forward_step for `megatron.bridge.training.pretrain`: the student runs up to the hidden states entering its
output layer; the sparse top-K KL consumes them with the output weight. No [s, b, V] logits on any rank.

Needs megatron-core's `GPTModel.forward(..., output_processor=...)` hook (0.19+, as in nvcr.io/nvidia/nemo:26.08).
Nothing here imports Bridge; megatron-core is imported only where a step runs.
"""
import inspect
from functools import partial

import torch

from ..loss import topk_kl_loss
from .config import OfflineKDConfig

KD_KEYS = ("topk_ids", "topk_logprobs")
MODEL_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
PACKED_KEYS = ("cu_seqlens", "cu_seqlens_q")


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers (a list of model chunks: the first)."""
    if isinstance(model, (list, tuple)):
        model = model[0]
    while hasattr(model, "module"):
        model = model.module
    return model


def supports_output_processor(model) -> bool:
    return "output_processor" in inspect.signature(unwrap(model).forward).parameters


def next_batch(data_iterator, device) -> dict:
    """The next batch, the tensors this step uses moved to `device`. Every pipeline stage takes the whole batch:
    the cache rows ([b, s, K], a few tens of MB at 32K) are small next to the activations."""
    if data_iterator is None:
        return {}
    batch = next(data_iterator)
    if any(batch.get(k) is not None for k in PACKED_KEYS):
        raise ValueError("offline KD does not support packed sequences (cu_seqlens in the batch): the cache holds "
                         "one row per position of an unpacked sample")
    return {k: batch[k].to(device, non_blocking=True) for k in MODEL_KEYS + KD_KEYS
            if torch.is_tensor(batch.get(k))}


def slice_for_context_parallel(batch: dict, cp_group) -> dict:
    """This CP rank's part of every [b, s, ...] tensor, by Megatron's own load-balanced split (2*cp chunks, rank r
    keeps chunks r and 2*cp-1-r), so cache rows follow their tokens. A no-op without CP."""
    if cp_group is None or cp_group.size() == 1:
        return batch
    from megatron.core.utils import get_batch_on_this_cp_rank

    extra = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters \
        else {}
    return get_batch_on_this_cp_rank(dict(batch), cp_group=cp_group, **extra)


def kd_output_processor(*, hidden_states, output_layer, output_weight, context, config, **_unused):
    """megatron-core's output_processor hook: per-position KD loss [b, s] from hidden states [s(/tp), b, h].

    `context` holds the batch's topk_ids / topk_logprobs / labels as [b, s, ...] and the loss settings.
    """
    if getattr(config, "use_mup", False):
        raise ValueError("offline KD does not apply MuP logit scaling; disable use_mup for the student")
    weight = output_weight if output_weight is not None else output_layer.weight
    tp_group = getattr(output_layer, "tp_group", None)
    if tp_group is None:
        from megatron.core import parallel_state
        if parallel_state.model_parallel_is_initialized():
            tp_group = parallel_state.get_tensor_model_parallel_group()
    labels = context.get("labels")
    losses = topk_kl_loss(
        hidden_states, weight,
        context["topk_ids"].transpose(0, 1), context["topk_logprobs"].transpose(0, 1),  # to Megatron's [s, b, K]
        labels=None if labels is None else labels.transpose(0, 1),
        tp_group=tp_group, sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
        valid_vocab_size=context.get("valid_vocab_size"), **context["loss_kwargs"])
    return losses.transpose(0, 1).contiguous()  # [b, s], as Bridge's masked loss expects


def kd_loss_func(loss_mask, output_tensor, *, name="kd loss", check_for_nan=False):
    """Megatron's loss_func convention: (sum of masked per-token losses, token count, {name: [sum, count]})."""
    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    if check_for_nan:
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        rsm = get_rerun_state_machine()
        rsm.validate_result(result=loss, rejection_func=torch.isnan, message="found NaN in local KD loss",
                            tolerance=0.0, fatal=True)
        rsm.validate_result(result=loss, rejection_func=torch.isinf, message="found Inf in local KD loss",
                            tolerance=0.0, fatal=True)
    num_tokens = mask.sum().detach().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.view(1).to(loss.dtype)])
    return loss, num_tokens, {name: report}


class OfflineKDForwardStep:
    """`pretrain(cfg, OfflineKDForwardStep(kd))`; Bridge injects its GlobalState as the first argument.

    Batches carrying cache rows train on the KD loss; batches without them (validation / test splits, which
    are not wrapped with the cache) report the plain LM loss when kd.eval_with_lm_loss.
    """

    def __init__(self, kd: OfflineKDConfig, valid_vocab_size: int | None = None):
        self.kd = kd.validate()
        self.valid_vocab_size = valid_vocab_size
        self._checked = False

    def __call__(self, state, data_iterator, model, return_schedule_plan: bool = False):
        if not self._checked:
            if not supports_output_processor(model):
                raise RuntimeError("megatron_kd.bridge needs megatron-core >= 0.19 (GPTModel.forward("
                                   "output_processor=...)); use the NeMo 26.08 container or newer")
            self._checked = True
        timers = getattr(state, "timers", None)
        if timers is not None:
            timers("batch-generator", log_level=2).start()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        batch = next_batch(data_iterator, device)
        cp_group = getattr(getattr(unwrap(model), "pg_collection", None), "cp", None)
        batch = slice_for_context_parallel(batch, cp_group)
        if timers is not None:
            timers("batch-generator").stop()
        check_nan = bool(getattr(getattr(getattr(state, "cfg", None), "rerun_state_machine", None),
                                 "check_for_nan_in_loss", False))
        return self.step(batch, model, return_schedule_plan, check_nan)

    def step(self, batch: dict, model, return_schedule_plan: bool = False, check_for_nan: bool = False):
        """Forward on one prepared batch; returns (output, loss_func) in Megatron's forward_step convention."""
        loss_mask = batch.get("loss_mask")
        args = (batch.get("tokens"), batch.get("position_ids"), batch.get("attention_mask"))
        kwargs = dict(labels=batch.get("labels"), loss_mask=loss_mask)
        if batch.get("topk_ids") is not None:
            kwargs.update(output_processor=kd_output_processor, output_processor_context={
                "topk_ids": batch["topk_ids"], "topk_logprobs": batch["topk_logprobs"], "labels": batch.get("labels"),
                "valid_vocab_size": self.valid_vocab_size, "loss_kwargs": self.kd.loss_kwargs()})
            name = "kd loss"
        elif batch.get("labels") is not None and not self.kd.eval_with_lm_loss:
            raise ValueError("batch without cache rows (topk_ids): wrap the dataset with enable_offline_kd")
        else:
            name = "lm loss"  # Megatron computes per-token CE itself when given labels
        # The schedule plan (MoE expert-parallel comm overlap) takes the same hook in megatron-core 0.19.
        output = model.build_schedule_plan(*args, **kwargs) if return_schedule_plan else model(*args, **kwargs)
        return output, partial(kd_loss_func, loss_mask, name=name, check_for_nan=check_for_nan)
