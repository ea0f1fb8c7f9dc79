"""A minimal Megatron-Core KD training step with per-phase memory, shared by the GPU benchmarks.

benchmarks/plan_validate.py and benchmarks/e2e_3b_bench.py measure what megatron_kd.plan predicts: a
GPTModel (local spec + SDPA, see build.py) wrapped in Megatron's DistributedDataParallel (fp32 main_grad
buffer), Megatron's optimizer (distributed Adam; torch's AdamW switched to its fused CUDA kernel), the
student's hidden states (no logits) into megatron_kd.topk_kl_loss against a synthetic top-K teacher.
On CPU (tests, --smoke) the same code runs with gloo, and LiveMemory stands in for the CUDA allocator.

This is deliberately small; megatron_kd.megatron's training loop is the product. Stand-ins written here until
that lands: the SDPA core attention (build.py) and the hidden-states hook for megatron-core < 0.19.
"""
import gc
import time

import torch
import torch.distributed as dist

from .build import build_gpt, hidden_states_forward, megatron_compat, output_weight, transformer_config
from .shapes import Layout, ModelShape
from .tracker import LiveMemory

GIB = float(1 << 30)


def on_cuda() -> bool:
    return torch.cuda.is_available()


def init_parallel(layout: Layout, seed: int = 1234) -> None:
    """(Re)initialize Megatron's process groups for `layout` (torch.distributed must be up)."""
    from megatron.core import parallel_state as ps
    from megatron_kd.megatron.cpu_patches import apply_cpu_patches, seed_model_parallel_rng
    apply_cpu_patches()
    megatron_compat()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    kw = dict(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
              context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep)
    if layout.etp is not None:
        kw["expert_tensor_parallel_size"] = layout.etp
    ps.initialize_model_parallel(**kw)
    seed_model_parallel_rng(seed)
    reset_moe_trackers()


def reset_moe_trackers() -> None:
    """Megatron's MoE aux-loss trackers are global and sized by the first model's depth; a deeper model
    built later in the same process would index past them."""
    try:  # megatron-core 0.16
        from megatron.core.transformer.moe import moe_utils
        get = getattr(moe_utils, "get_moe_layer_wise_logging_tracker", None)
        if get is not None:
            get().clear()
    except Exception:
        pass
    try:  # megatron-core 0.19
        from megatron.core.transformer.moe import moe_logging
        moe_logging.destroy_moe_metrics_tracker()
    except Exception:
        pass


def tp_group():
    from megatron.core import parallel_state as ps
    return ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None


def build_training(shape: ModelShape, layout: Layout, *, recompute="full", recompute_layers=None,
                   grad_fp32=True, dist_opt=True, adam="fused", lr=1e-5, swiglu_fusion=False, optimizer="adam"):
    """(DDP-wrapped model, Megatron optimizer, info dict). adam: 'fused' (CUDA) or torch's default.
    optimizer="lean_adam": bf16 grad buffer, LeanAdamW in Megatron's FP32Optimizer (as train.optimizer)."""
    lean = optimizer == "lean_adam"
    if lean:
        grad_fp32 = dist_opt = False
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    cpu = not on_cuda()
    cfg = transformer_config(shape, layout, recompute=recompute, recompute_layers=recompute_layers, cpu=cpu,
                             swiglu_fusion=swiglu_fusion)
    model = build_gpt(shape, layout, cfg)
    if cpu:
        model = model.bfloat16()
    else:
        model = model.cuda()
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_fp32, overlap_grad_reduce=False,
                                            use_distributed_optimizer=dist_opt)
    ddp = DistributedDataParallel(cfg, ddp_cfg, model)
    if lean:
        from ..megatron.config import TrainConfig
        from ..megatron.optim import lean_optimizer
        ocfg = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                               adam_eps=1e-8, bf16=True, params_dtype=torch.bfloat16, clip_grad=1.0)
        opt = lean_optimizer([ddp], ocfg, TrainConfig(optimizer="lean_adam", precision="bf16"), not cpu)
        impl = "lean_adam"
    elif cpu:  # Megatron's mixed-precision optimizers hard-code device="cuda": same memory layout, stand-in
        opt = CPUMixedPrecisionAdam(ddp, lr=lr)
        impl = "for_loop"
    else:
        ocfg = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                               adam_eps=1e-8, bf16=True, params_dtype=torch.bfloat16,
                               use_distributed_optimizer=dist_opt, clip_grad=1.0)
        opt = get_megatron_optimizer(ocfg, [ddp])
        impl = set_adam_impl(opt, adam)
    info = dict(recompute=recompute, recompute_layers=recompute_layers, grad_fp32=grad_fp32, optimizer=optimizer,
                distributed_optimizer=dist_opt, adam_impl=impl, swiglu_fusion=cfg.bias_activation_fusion)
    return ddp, opt, info


class CPUMixedPrecisionAdam:
    """CPU stand-in for Megatron's Float16 optimizer (which needs CUDA): fp32 main params, AdamW state,
    grads taken from DDP's main_grad buffer, bf16 params refreshed after the step. Same bytes per parameter."""

    def __init__(self, ddp, lr=1e-5):
        self.params = [p for p in ddp.parameters() if p.requires_grad]
        self.main = [p.detach().float().clone() for p in self.params]
        self.optimizer = torch.optim.AdamW(self.main, lr=lr, weight_decay=0.01, foreach=False)

    def zero_grad(self):
        for m in self.main:
            m.grad = None

    def step(self):
        for p, m in zip(self.params, self.main):
            g = getattr(p, "main_grad", None)
            m.grad = g.view_as(m) if g is not None and g.dtype == torch.float32 else (
                g.float() if g is not None else None)
        norm = torch.sqrt(sum((m.grad.float() ** 2).sum() for m in self.main if m.grad is not None))
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.main):
                p.copy_(m)
        return True, float(norm), None


def torch_optimizers(opt):
    subs = getattr(opt, "chained_optimizers", None) or [opt]
    return [getattr(o, "optimizer", o) for o in subs]


def set_adam_impl(opt, impl: str) -> str:
    """Switch Megatron's torch AdamW (no TE/apex) to its fused CUDA kernel; returns the impl in use."""
    tos = torch_optimizers(opt)
    if impl != "fused":
        return "foreach" if on_cuda() else "for_loop"
    for o in tos:
        if not isinstance(o, torch.optim.Optimizer):
            return type(o).__name__
        for g in o.param_groups:
            g["fused"], g["foreach"] = True, False
        o.defaults["fused"], o.defaults["foreach"] = True, False
    return "fused"


def synthetic_batch(shape: ModelShape, seq: int, k: int, device, seed: int = 0, mbs: int = 1):
    """tokens/positions [b, s] and a sharp random teacher top-K in Megatron's [s, b, K] layout."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, shape.vocab_size, (mbs, seq), generator=g).to(device)
    pos = torch.arange(seq, device=device).unsqueeze(0).expand(mbs, seq)
    n = seq * mbs
    base = torch.randint(0, shape.vocab_size, (n, 1), generator=g)
    ids = (base + torch.arange(k) * 7919) % shape.vocab_size
    x = torch.randn(n, k, generator=g).mul_(3.0).sort(dim=1, descending=True).values
    logp = torch.log_softmax(x, dim=1) + torch.log(torch.tensor(0.9))
    ids = ids.view(mbs, seq, k).transpose(0, 1).contiguous().to(device)
    logp = logp.view(mbs, seq, k).transpose(0, 1).contiguous().to(device)
    return dict(tokens=tokens, position_ids=pos, topk_ids=ids, topk_logprobs=logp)


def kd_loss(ddp, batch, shape, layout, impl, teacher_targets=None):
    """Student forward (hidden states, no logits) + topk_kl_loss; returns the loss tensor."""
    from megatron_kd import topk_kl_loss
    hidden = hidden_states_forward(ddp, batch["tokens"], batch["position_ids"])   # [s(/tp), b, H]
    ids, logp = teacher_targets or (batch["topk_ids"], batch["topk_logprobs"])
    return topk_kl_loss(hidden, output_weight(ddp), ids, logp, impl=impl, tp_group=tp_group(),
                        sequence_parallel=layout.sp, valid_vocab_size=shape.vocab_size)


class Meter:
    """Peak bytes per phase: torch.cuda's allocator on GPU, LiveMemory on CPU."""

    def __init__(self):
        self.cuda = on_cuda()
        self.live = None
        if not self.cuda:
            self.live = LiveMemory([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])

    def __enter__(self):
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)

    def reset(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.live.reset_peak()

    def current(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else self.live.current

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return self.live.peak


def train_step(ddp, opt, batch, shape, layout, impl, meter: Meter | None = None, teacher_fn=None):
    """One step; returns dict(loss, seconds, and per-phase peaks/current bytes when a meter is given)."""
    out = {}
    sync = torch.cuda.synchronize if on_cuda() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    ddp.zero_grad_buffer()
    opt.zero_grad()
    if meter:
        out["static_bytes"] = meter.current()
        meter.reset()
    targets = None
    if teacher_fn is not None:
        targets = teacher_fn(batch)
        if meter:
            out["teacher_peak"] = meter.peak()
            meter.reset()
    loss = kd_loss(ddp, batch, shape, layout, impl, targets)
    if meter:
        out["forward_peak"] = meter.peak()
        out["after_forward"] = meter.current()
        meter.reset()
    loss.backward()
    del targets
    ddp.finish_grad_sync()
    if meter:
        out["backward_peak"] = meter.peak()
        out["after_backward"] = meter.current()
        meter.reset()
    ok, gnorm, _ = opt.step()
    if meter:
        out["step_peak"] = meter.peak()
    sync()
    out["seconds"] = time.perf_counter() - t0
    out["loss"] = float(loss.detach())
    out["grad_norm"] = float(gnorm) if gnorm is not None else None
    out["update_ok"] = bool(ok)
    if meter:
        out["peak"] = max(out[k] for k in ("teacher_peak", "forward_peak", "backward_peak", "step_peak")
                          if k in out)
    return out


def release(ddp) -> None:
    """Break Megatron DDP's reference cycle through C++ autograd nodes (grad_accs -> hook closure -> DDP),
    which gc cannot collect: without this every model built in a process stays allocated."""
    accs = getattr(ddp, "grad_accs", None)
    if isinstance(accs, list):
        accs.clear()
    for p in ddp.parameters():
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if hooks:
            hooks.clear()
        for attr in ("main_grad", "grad"):
            if getattr(p, attr, None) is not None:
                setattr(p, attr, None)


def free_all(*objs):
    """Return cached GPU memory between variants (callers drop their references first)."""
    gc.collect()
    if on_cuda():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def init_distributed():
    """torch.distributed from torchrun's environment (or a single local process)."""
    import os
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if on_cuda():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")

