"""Megatron DDP, optimizer and LR schedule.

GPU: Megatron's DistributedDataParallel + get_megatron_optimizer (DistributedOptimizer when
parallel.use_distributed_optimizer), as Megatron-LM sets them up.
CPU: the same DDP (its grad buffers work on gloo) and Megatron's FP32Optimizer around torch AdamW; only the
two CUDA-bound pieces of FP32Optimizer (a loss-scale tensor made on 'cuda' and the grad-norm kernels) are
replaced. Both keep Megatron's sharded optimizer state, so checkpoints look the same on CPU and GPU.
"""
import math

import torch
import torch.distributed as dist

from ..recipe.schema import ParallelConfig, TrainConfig


def _dist_opt(t: TrainConfig, p: ParallelConfig, cuda: bool) -> bool:
    return p.use_distributed_optimizer and cuda and t.optimizer == "adam"


def wrap_ddp(chunks, config, p: ParallelConfig, cuda: bool, t: TrainConfig | None = None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    t = t or TrainConfig()
    lean = t.optimizer == "lean_adam"  # bf16 grads: lean_adam reads them as they are
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=(config.bf16 or config.fp16) and not lean,
        overlap_grad_reduce=p.overlap_grad_reduce and cuda,
        overlap_param_gather=p.overlap_param_gather and _dist_opt(t, p, cuda),
        use_distributed_optimizer=_dist_opt(t, p, cuda), check_for_nan_in_grad=False)
    return [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]


def optimizer_config(t: TrainConfig, p: ParallelConfig, cuda: bool):
    from megatron.core.optimizer import OptimizerConfig
    return OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad, bf16=t.precision == "bf16",
        fp16=t.precision == "fp16", params_dtype=torch.float32 if t.precision == "fp32" else
        (torch.bfloat16 if t.precision == "bf16" else torch.float16),
        use_distributed_optimizer=_dist_opt(t, p, cuda))


def build_optimizer(ddp_chunks, t: TrainConfig, p: ParallelConfig, cuda: bool):
    cfg = optimizer_config(t, p, cuda)
    if t.optimizer == "lean_adam":
        return lean_optimizer(ddp_chunks, cfg, t, cuda)
    if cuda:
        from megatron.core.optimizer import get_megatron_optimizer
        return get_megatron_optimizer(cfg, ddp_chunks)
    return cpu_optimizer(ddp_chunks, cfg)


def _param_groups(chunks, weight_decay: float = 0.0):
    """Megatron's default rule: no weight decay on biases and 1-D parameters (norms)."""
    decay, no_decay = [], []
    for c in chunks:
        for name, prm in c.named_parameters():
            if prm.requires_grad:
                (no_decay if name.endswith(".bias") or prm.dim() == 1 else decay).append(prm)
    keys = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}  # Megatron's group identity
    # weight_decay x wd_mult from the start: the scheduler sets it again at each step, a bare optimizer keeps it
    groups = [{"params": decay, "wd_mult": 1.0, "weight_decay": weight_decay, **keys},
              {"params": no_decay, "wd_mult": 0.0, "weight_decay": 0.0, **keys}]
    return [g for g in groups if g["params"]]


def lean_optimizer(ddp_chunks, cfg, t: TrainConfig, cuda: bool):
    """LeanAdamW inside Megatron's FP32Optimizer: main_grad (bf16) as grads, Megatron's clipping, grad norm and
    sharded checkpoint state (the remainder and moments are param-shaped tensors)."""
    from .lean_adam import LeanAdamW
    opt = LeanAdamW(_param_groups(ddp_chunks, cfg.weight_decay), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                    weight_decay=cfg.weight_decay, exp_avg_dtype=t.exp_avg_dtype, exp_avg_sq_dtype=t.exp_avg_sq_dtype)
    # Megatron's own clipping asserts fp32 grads: the torch clipping below takes the bf16 main_grads as they are
    return _fp32_optimizer_class()(opt, cfg, lambda o, config=None: o.init_state())


def cpu_optimizer(ddp_chunks, cfg):
    groups = _param_groups(ddp_chunks, cfg.weight_decay)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2),
                            eps=cfg.adam_eps, foreach=True)

    def init_state_fn(o, config=None):
        for group in o.param_groups:
            for prm in group["params"]:
                if len(o.state[prm]) == 0:
                    o.state[prm]["exp_avg"] = torch.zeros_like(prm.data)
                    o.state[prm]["exp_avg_sq"] = torch.zeros_like(prm.data)
                    o.state[prm]["step"] = torch.zeros(())  # torch AdamW keeps a per-param step

    return _fp32_optimizer_class()(opt, cfg, init_state_fn)


def _fp32_optimizer_class():
    """Megatron's FP32Optimizer without its two CUDA-bound pieces (a loss-scale tensor made on 'cuda', the
    fp32-only grad-norm kernels): clipping in torch, on any device and grad dtype."""
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    class TorchClipFP32Optimizer(FP32Optimizer):
        def __init__(self, optimizer, config, init_state_fn):
            MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
            params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer else []
            self._scale = torch.ones(1, device=params[0].device if params else "cpu")
            self.is_stub_optimizer = optimizer is None

        @torch.no_grad()
        def clip_grad_norm(self, clip_grad: float) -> float:
            # TP duplicates and shared params counted once (megatron-core renamed the getter after 0.16)
            get = getattr(self, "get_main_grads_for_grad_norm", None) or self.get_grads_for_grad_norm
            grads = get()
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32) if grads else []  # bf16 grads: fp32 norms
            sq = torch.stack(norms).double().pow(2).sum().reshape(1) if grads else torch.zeros(1, dtype=torch.float64)
            group = self.get_grad_stats_parallel_group()
            if dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
            norm = float(sq.sqrt())
            self.nonfinite_grads = not math.isfinite(norm)  # step_with_ready_grads skips the update
            coef = clip_grad / (norm + 1.0e-6)
            if coef < 1.0:
                torch._foreach_mul_([p.grad for p in self.get_parameters() if p.grad is not None], coef)
            return norm

        def step_with_ready_grads(self) -> bool:
            """A NaN/inf gradient skips the update (as Megatron's mixed-precision optimizers do on overflow)
            instead of writing NaN into weights and moments."""
            if getattr(self, "nonfinite_grads", False):
                self.nonfinite_grads = False
                return False
            return super().step_with_ready_grads()

    return TorchClipFP32Optimizer


def build_scheduler(optimizer, t: TrainConfig):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    decay = t.lr_decay_iters or t.iters
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if t.lr_warmup_iters else t.lr, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters, lr_decay_steps=max(decay, t.lr_warmup_iters + 1),
        lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=t.iters,
        wd_incr_style="constant", wsd_decay_steps=max(1, decay // 10) if t.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style="linear" if t.lr_decay_style == "WSD" else None)


def loss_scale(config) -> float:
    """The grad_output Megatron's schedule feeds into the loss's backward, config.grad_scale_func(1): the fp16 loss
    scale (read once per micro-batch, one host sync), 1.0 under bf16 / fp32 (no grad scaler: no sync). The fused
    loss takes it as topk_kl_loss(grad_scale=) and writes main_grad during forward already scaled by it."""
    func = getattr(config, "grad_scale_func", None)
    if func is None or not getattr(config, "fp16", False):
        return 1.0
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return float(func(torch.ones(1, device=dev)))


def set_model_hooks(config, ddp_chunks, optimizer) -> None:
    """What Megatron-LM's training loop sets on the model config for its schedules."""
    from megatron.core.distributed import finalize_model_grads
    config.no_sync_func = [c.no_sync for c in ddp_chunks] if len(ddp_chunks) > 1 else ddp_chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if getattr(ddp_chunks[0].ddp_config, "overlap_grad_reduce", False):
        config.grad_sync_func = [c.start_grad_sync for c in ddp_chunks]
        if len(ddp_chunks) == 1:
            config.grad_sync_func = config.grad_sync_func[0]
    if getattr(ddp_chunks[0].ddp_config, "overlap_param_gather", False):
        config.param_sync_func = [c.start_param_sync for c in ddp_chunks]
        if len(ddp_chunks) == 1:
            config.param_sync_func = config.param_sync_func[0]
