"""A forward_step for `megatron.bridge.training.pretrain`: the student runs up to the hidden states entering its
output layer and megatron-kd's KD head (megatron_kd.training.step.KDHead, the one `megatron-kd train` uses)
turns them into the masked loss sum with the output weight. No [s, b, V] logits on any rank. The hook is
megatron-core's output_processor (0.19+, the NeMo 26.08 container) or, on older versions, megatron-kd's
output-layer swap (megatron_kd.models.hook).

Bridge-specific here: its call convention (GlobalState first, timers), its NaN checks, validation batches
without cache rows, and the CP split called the way megatron-core 0.16 and 0.19 both accept. Nothing here
imports Bridge; megatron-core is imported only where a step runs.
"""
from dataclasses import fields
from functools import partial
from types import SimpleNamespace

import torch

from ..recipe.schema import KDConfig, OfflineKD
from ..models.hook import forward_with_head
from ..models.builder import unwrap
from ..training.step import KDHead, StepLoss, loss_func, slice_for_context_parallel
from .config import OfflineKDConfig

KD_KEYS = ("topk_ids", "topk_logprobs")
MODEL_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
PACKED_KEYS = ("cu_seqlens", "cu_seqlens_q")
_NO_PARTS = SimpleNamespace(kl=None, ce=None)  # a loss with no KL / CE split to report


def kd_settings(kd: OfflineKDConfig) -> KDConfig:
    """The `kd` section of megatron-kd's own recipes that this Bridge section stands for."""
    return KDConfig(mode="offline", **{f.name: getattr(kd, f.name) for f in fields(OfflineKD)})


def next_batch(data_iterator, device, keep_attention_mask: bool = False) -> dict:
    """The next batch, the tensors this step uses moved to `device`. Every pipeline stage takes the whole batch:
    the cache rows ([b, s, K], a few tens of MB at 32K) are small next to the activations.

    attention_mask stays behind, as in Bridge's get_batch, unless the dataset config sets
    skip_getting_attention_mask_from_dataset=False: Bridge's datasets build a [b, 1, s, s] mask by default
    (about 1 GiB per sample at 32K) that causal attention does not read."""
    if data_iterator is None:
        return {}
    batch = next(data_iterator)
    if any(batch.get(k) is not None for k in PACKED_KEYS):
        raise ValueError("offline KD does not support packed sequences (cu_seqlens in the batch): the cache holds "
                         "one row per position of an unpacked sample")
    keys = MODEL_KEYS + KD_KEYS if keep_attention_mask else tuple(k for k in MODEL_KEYS + KD_KEYS
                                                                  if k != "attention_mask")
    return {k: batch[k].to(device, non_blocking=True) for k in keys if torch.is_tensor(batch.get(k))}


def keeps_attention_mask(state) -> bool:
    """Bridge's rule (gpt_step.get_batch): the dataset's mask is used only when the dataset config sets
    skip_getting_attention_mask_from_dataset=False."""
    dataset = getattr(getattr(state, "cfg", None), "dataset", None)
    return not getattr(dataset, "skip_getting_attention_mask_from_dataset", True)


def kd_loss_func(loss_mask, head, output_tensor, *, prefix="kd", check_for_nan=False):
    """Megatron's loss_func convention (masked per-token loss sum, token count, report) plus Bridge's NaN/Inf
    checks; report keys '<prefix> loss' and, when the head split them, '<prefix> kl' / '<prefix> ce'."""
    loss, count, report = loss_func(loss_mask, head or _NO_PARTS, output_tensor)
    if check_for_nan:
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        rsm = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rsm.validate_result(result=loss, rejection_func=reject, message=f"found {what} in local KD loss",
                                tolerance=0.0, fatal=True)
    names = {"total": "loss"}
    return loss, count, {f"{prefix} {names.get(k, k)}": v for k, v in report.items()}


class OfflineKDForwardStep:
    """`pretrain(cfg, OfflineKDForwardStep(kd))`; Bridge injects its GlobalState as the first argument.

    Batches carrying cache rows train on the KD loss; batches without them (validation / test splits, which
    are not wrapped with the cache) report the plain LM loss when kd.eval_with_lm_loss.
    """

    def __init__(self, kd: OfflineKDConfig, valid_vocab_size: int | None = None):
        self.kd = kd.validate()
        self.settings = kd_settings(self.kd)
        self.loss = StepLoss.of(self.settings)
        self.valid_vocab_size = valid_vocab_size

    def __call__(self, state, data_iterator, model, return_schedule_plan: bool = False):
        timers = getattr(state, "timers", None)
        if timers is not None:
            timers("batch-generator", log_level=2).start()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        batch = next_batch(data_iterator, device, keeps_attention_mask(state))
        cp_group = getattr(getattr(unwrap(model), "pg_collection", None), "cp", None)
        batch = slice_for_context_parallel(batch, cp_group)
        if timers is not None:
            timers("batch-generator").stop()
        check_nan = bool(getattr(getattr(getattr(state, "cfg", None), "rerun_state_machine", None),
                                 "check_for_nan_in_loss", False))
        return self.step(batch, model, return_schedule_plan, check_nan)

    def step(self, batch: dict, model, return_schedule_plan: bool = False, check_for_nan: bool = False):
        """Forward on one prepared batch; returns (output, loss_func) in Megatron's forward_step convention."""
        if return_schedule_plan:
            raise NotImplementedError("offline KD builds no MoE schedule plans: set "
                                      "model.overlap_moe_expert_parallel_comm=False")
        args = (batch.get("tokens"), batch.get("position_ids"), batch.get("attention_mask"))
        if batch.get("topk_ids") is None:
            if batch.get("labels") is not None and not self.kd.eval_with_lm_loss:
                raise ValueError("batch without cache rows (topk_ids): wrap the dataset with enable_offline_kd")
            output = model(*args, labels=batch.get("labels"))  # Megatron's own per-token CE
            return output, partial(kd_loss_func, batch.get("loss_mask"), None, prefix="lm",
                                   check_for_nan=check_for_nan)
        gpt = unwrap(model)
        # earlier pipeline stages have no output layer: they send hidden states on, the head runs on the last
        head = KDHead(batch, self.loss, self.valid_vocab_size, split=self.kd.log_ce).bind(gpt) \
            if gpt.post_process else None
        output = forward_with_head(model, head, *args)
        return output, partial(kd_loss_func, batch["loss_mask"], head, check_for_nan=check_for_nan)
