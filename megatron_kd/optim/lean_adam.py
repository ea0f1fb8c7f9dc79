"""train.optimizer=lean_adam: AdamW that keeps 10 bytes of state per bf16 parameter instead of 16.

Megatron's mixed-precision optimizer holds, per parameter, a bf16 weight, an fp32 main grad, an fp32 master
copy and fp32 Adam moments: 18 bytes. Without Transformer Engine's precision-aware FusedAdam (not on every
machine) this is what fits a 3B student at 32K in less memory than the transformers baseline:
  weight bf16 (2) + master remainder int16 (2; weight + remainder is the exact fp32 master)
  + grad bf16 (2, Megatron DDP with grad_reduce_in_fp32 off) + exp_avg bf16 (2) + exp_avg_sq fp32 (4) = 12.
exp_avg in bf16 is safe (each step moves it by 1 - beta1 = 10%, far above its 0.4% rounding); exp_avg_sq
moves by 1 - beta2 (0.1-5%) and stays fp32 unless asked (bf16 would round beta2 = 0.999 updates away).
It wraps into Megatron's FP32Optimizer (grads from main_grad, clipping, grad norm, sharded checkpoints);
states are not sharded over data-parallel ranks, so it is meant for DP = 1..2 (one-GPU students); at larger
DP Megatron's distributed optimizer divides its 12 bytes of state by DP and wins.
"""
import torch

from ..kernels.adam import adamw_step_, adamw_update_

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class LeanAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 exp_avg_dtype="bf16", exp_avg_sq_dtype="fp32"):
        for name, d in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if d not in DTYPES:
                raise ValueError(f"lean_adam {name} must be one of {sorted(DTYPES)}, got {d!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, step=0,
                                      exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype))
        for g in self.param_groups:
            for p in g["params"]:
                if not p.is_floating_point() or p.dtype == torch.float16:
                    raise ValueError(f"train.optimizer=lean_adam updates bf16 (or fp32) weights; got a {p.dtype} "
                                     f"parameter of shape {tuple(p.shape)}: set train.precision=bf16 "
                                     "(or train.optimizer=adam)")

    def init_state(self) -> None:
        """Zero moments; remainder 0 makes the current bf16 weight the master value."""
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if "exp_avg" in st:
                    continue
                lean = p.dtype == torch.bfloat16  # fp32 weights (norms outside Float16Module): plain AdamW
                like = dict(memory_format=torch.contiguous_format)
                if lean:
                    st["master_rem"] = torch.zeros_like(p, dtype=torch.int16, **like)
                st["exp_avg"] = torch.zeros_like(p, dtype=DTYPES[g["exp_avg_dtype"]] if lean else p.dtype, **like)
                st["exp_avg_sq"] = torch.zeros_like(p, dtype=DTYPES[g["exp_avg_sq_dtype"]] if lean else p.dtype,
                                                    **like)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.init_state()
        for g in self.param_groups:
            g["step"] += 1
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                w = p.data
                if not w.is_contiguous():
                    raise ValueError("lean_adam needs contiguous parameters (Megatron's DDP param buffer gives them)")
                hp = dict(lr=g["lr"], beta1=b1, beta2=b2, eps=g["eps"], weight_decay=g["weight_decay"],
                          step=g["step"])
                if "master_rem" in st:
                    adamw_step_(w, st["master_rem"], p.grad.contiguous(), st["exp_avg"], st["exp_avg_sq"], **hp)
                else:  # an fp32 weight is its own master
                    adamw_update_(w, p.grad, st["exp_avg"], st["exp_avg_sq"], g["lr"], b1, b2, g["eps"],
                                  g["weight_decay"], 1 - b1 ** g["step"], 1 - b2 ** g["step"])
        return loss

    def load_state_dict(self, state_dict):
        """torch's loader casts every floating parameter's state to the parameter's dtype (the int16
        remainder and fp32 moments would become bf16): map ids with torch, copy the tensors as saved."""
        saved = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if i in saved:
                self.state[p] = {k: v.to(device=p.device) if torch.is_tensor(v) else v for k, v in saved[i].items()}
