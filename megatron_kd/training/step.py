"""forward_step and loss_func in Megatron's convention, for the three modes.

    offline  targets = the cache's top-K rows (in the batch, read by the data loader)
    online   targets = a frozen teacher's top-K, computed on the fly with the cache builder's vocab-parallel top-K
    ce       no teacher: cross-entropy on the labels

`KDStep` is a forward_step_func for `get_forward_backward_func()` (GPU, any PP) and for the CPU driver in
schedule.py. The student's output layer never makes logits: the head below computes the masked loss sum from
the hidden states and the output weight (hook.py). loss_func returns (sum of masked per-token losses, token
count, report) so Megatron divides by the global token count (calculate_per_token_loss=True).
"""
from dataclasses import dataclass
from functools import partial

import torch

from ..loss import LossOptions, VocabLayout, kd_loss
from ..recipe.schema import KDConfig
from ..recipe.targets import TargetSource
from ..models.hook import forward_with_head, output_layout
from ..models.builder import unwrap
from ..optim.setup import loss_scale

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask", "topk_ids", "topk_logprobs")


@dataclass(frozen=True)
class StepLoss:
    """A step's loss options, built once from the kd section: `train`, the loss the step trains on (a masked sum;
    ce mode is CE alone, weight 1), and `report`, the forward-only CE pass at the same temperature that splits a
    KD total into KL and CE and fills the bucket-tail monitor."""
    train: LossOptions
    report: LossOptions

    @classmethod
    def of(cls, kd: KDConfig) -> "StepLoss":
        if TargetSource.of(kd).distills:
            train = kd.loss_options(reduction="sum")
        else:
            train = LossOptions(kl_weight=0.0, ce_weight=1.0, temperature=1.0, tail="none", impl=kd.impl,
                                chunk_size=kd.chunk_size, reduction="sum")
        # "chunked": no gradient work in forward
        report = LossOptions(kl_weight=0.0, ce_weight=1.0, impl="chunked", chunk_size=train.chunk_size,
                             temperature=train.temperature, cache_temperature=train.cache_temperature,
                             reduction="sum", monitor=True)
        return cls(train, report)


class KDHead:
    """Output-layer replacement: the masked loss sum from hidden [s(/tp), b, H] and weight [V/tp, H].

    Targets come in the batch layout [b, s, ...] and are viewed as Megatron's [s, b, ...]. The loss is one
    masked sum (reduction "sum" with the loss mask), so on GPUs it runs the fused impl, which does its gradient
    work in forward; the head returns it at position (0, 0) of an [s, b] tensor of zeros (Megatron's schedules
    want a per-position output) and loss_func sums that tensor. When `split` is set the head also keeps the KL
    and CE sums (detached) for the report: one extra forward-only pass over the output layer, only when the
    total does not already tell them apart.
    """

    summed = True  # loss_func: the output tensor holds the masked sum already

    def __init__(self, batch: dict, loss: StepLoss, valid_vocab_size: int, split: bool = True,
                 grad_scale: float = 1.0):
        self.loss, self.valid_vocab_size = loss, valid_vocab_size
        self.grad_scale = grad_scale  # loss-core hook: the loss scale backward brings (optim.loss_scale)
        self.labels, self.loss_mask = batch["labels"], batch.get("loss_mask")
        self.ids, self.logp = batch.get("topk_ids"), batch.get("topk_logprobs")
        self.split = split
        self.kl = self.ce = self.kl_bucket = None
        self.layout = VocabLayout(valid_vocab_size=valid_vocab_size)

    def bind(self, gpt) -> "KDHead":
        tp_group, sequence_parallel = output_layout(gpt)
        self.layout = VocabLayout(tp_group, sequence_parallel, valid_vocab_size=self.valid_vocab_size)
        return self

    def __call__(self, hidden, weight):
        labels = self.labels.transpose(0, 1)  # [s, b]
        mask = None if self.loss_mask is None else self.loss_mask.transpose(0, 1)
        if self.ids is None:  # ce mode: no teacher slots
            s, b = labels.shape
            ids = torch.empty((s, b, 0), dtype=torch.int64, device=labels.device)
            logp = torch.empty((s, b, 0), dtype=torch.float32, device=labels.device)
        else:
            ids, logp = self.ids.transpose(0, 1), self.logp.transpose(0, 1)
        opts = self.loss.train
        total = kd_loss(hidden, weight, ids, logp, opts, self.layout, labels=labels if opts.ce_weight else None,
                        loss_mask=mask, grad_scale=self.grad_scale)
        if not opts.kl_weight:
            self.ce = total.detach() / opts.ce_weight
        else:
            if self.split:  # forward-only CE over the same hidden states, and the bucket-tail KL at T (a true
                # divergence, >= 0) for the report (the monitor)
                metrics = {}
                with torch.no_grad():
                    self.ce = kd_loss(hidden.detach(), weight.detach(), ids, logp, self.loss.report, self.layout,
                                      labels=labels, loss_mask=mask, metrics=metrics)
                self.kl_bucket = metrics["kl_bucket"]
            if self.ce is not None or not opts.ce_weight:
                ce_part = opts.ce_weight * self.ce if opts.ce_weight else 0.0
                self.kl = (total.detach() - ce_part) / opts.kl_scale
        at = torch.zeros(labels.shape, dtype=total.dtype, device=total.device)
        at[0, 0] = 1.0
        return total * at  # [s, b]: the sum at (0, 0); its gradient goes straight into the loss's backward


def loss_func(loss_mask: torch.Tensor, head: KDHead, output_tensor: torch.Tensor):
    """Megatron convention: (masked per-token loss sum, token count, {name: [sum, count]})."""
    mask = loss_mask.reshape(-1).float()
    if getattr(head, "summed", False):  # KDHead's output holds the masked sum already
        loss = output_tensor.float().sum()
    else:
        loss = torch.sum(output_tensor.reshape(-1).float() * mask)
    count = mask.sum()
    report = {"total": torch.stack([loss.detach(), count])}
    for name in ("kl", "ce", "kl_bucket"):
        val = getattr(head, name, None)
        if val is not None:
            val = val if val.dim() == 0 else torch.sum(val.transpose(0, 1).reshape(-1).float() * mask)
            report[name] = torch.stack([val.float(), count])
    return loss, count.detach().to(torch.int), report


def next_batch(data_iterator, device, cp_group=None) -> dict:
    """The next micro-batch on `device`, sliced for this context-parallel rank (cache rows like the tokens)."""
    batch = next(data_iterator)
    batch = {k: batch[k].to(device, non_blocking=True) for k in BATCH_KEYS if torch.is_tensor(batch.get(k))}
    return slice_for_context_parallel(batch, cp_group)


def slice_for_context_parallel(batch: dict, cp_group) -> dict:
    """This CP rank's part of every [b, s, ...] tensor, by Megatron's own load-balanced split (2*cp chunks, rank r
    keeps chunks r and 2*cp-1-r), so cache rows follow their tokens. A no-op without CP."""
    if cp_group is None or cp_group.size() == 1:
        return batch
    import inspect
    from megatron.core.utils import get_batch_on_this_cp_rank
    # 0.19 added a required `is_hybrid_cp` argument; 0.16 does not know it
    extra = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters \
        else {}
    return get_batch_on_this_cp_rank(dict(batch), cp_group=cp_group, **extra)


class KDStep:
    """forward_step_func(data_iterator, model) -> (output, partial(loss_func, ...)) for one micro-batch."""

    def __init__(self, kd: KDConfig, valid_vocab_size: int, teacher=None, split_report: bool = True,
                 device=None, cp_group=None):
        self.targets = TargetSource.of(kd)
        if self.targets.teacher_each_step and teacher is None:
            raise ValueError("online mode needs a teacher (megatron_kd.teacher.megatron.OnlineTeacher)")
        self.kd, self.valid_vocab_size, self.teacher = kd, valid_vocab_size, teacher
        self.loss = StepLoss.of(kd)  # the loss options, once per run, not per micro-batch
        self.split_report, self.cp_group = split_report, cp_group
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                 else torch.device("cpu"))

    def __call__(self, data_iterator, model, *unused):
        batch = next_batch(data_iterator, self.device, self.cp_group)
        if not unwrap(model).post_process:  # an earlier pipeline stage: hidden states out, no loss here
            out = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"))
            return out, partial(loss_func, batch["loss_mask"], None)
        if self.targets.teacher_each_step:
            batch["topk_ids"], batch["topk_logprobs"] = self.teacher.topk(batch)
        elif not self.targets.distills:
            batch.pop("topk_ids", None)
            batch.pop("topk_logprobs", None)
        elif "topk_ids" not in batch:
            raise ValueError("offline mode: the batch has no topk_ids; wrap the dataset with the cache "
                             "(megatron_kd.cache.TopKDataset)")
        gpt = unwrap(model)
        head = KDHead(batch, self.loss, self.valid_vocab_size, self.split_report,
                      loss_scale(getattr(gpt, "config", None))).bind(gpt)
        output = forward_with_head(model, head, batch["tokens"], batch["position_ids"], batch.get("attention_mask"))
        return output, partial(loss_func, batch["loss_mask"], head)
