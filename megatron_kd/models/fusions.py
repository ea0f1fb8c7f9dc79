"""Exact fusions for forwards without autograd (the teacher's): megatron-core's unfused gated SiLU and rotary
embedding, and torch's RMSNorm composite, replaced by kernels that give the same bits (kernels/swiglu.py,
kernels/rope.py, kernels/rmsnorm.py) in fewer passes over memory.

A layer takes the fused path only where its result is provably eager's: CUDA, 16-bit activations, no autograd,
and megatron-core's unfused branch with the options the kernels reproduce (SiLU gate without bias or clamp;
non-interleaved RoPE over the whole head, one frequency row per position). Anything else runs megatron-core's
own code, so installing the fusions never changes what a model computes.
"""
import contextlib
import functools
import types

import torch
import torch.nn.functional as F

_HALF = (torch.bfloat16, torch.float16)
_HEAD_DIMS = (16, 32, 64, 128, 256)  # the RoPE kernel takes half a head as one power-of-two block


def _fusable(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in _HALF and not torch.is_grad_enabled() and _triton()


@functools.lru_cache(maxsize=None)
def _triton() -> bool:
    from ..kernels import fused_unavailable
    return fused_unavailable(cuda=True) is None  # without Triton megatron-core's own code runs


def _mlp_forward(self, hidden_states, per_token_scale=None, **kwargs):
    """MLP.forward with the gate, bias-free SiLU case fused; other cases go to megatron-core's forward."""
    from ..kernels.swiglu import swiglu_eager
    if per_token_scale is not None or not _fusable(hidden_states):
        return type(self).forward(self, hidden_states, per_token_scale, **kwargs)
    inter, _ = self.linear_fc1(hidden_states)  # no bias: mlp_fusable
    inter = swiglu_eager(inter, self.config.glu_linear_offset)
    return self.linear_fc2(inter)


def mlp_fusable(mlp) -> bool:
    c = mlp.config
    return (c.gated_linear_unit and mlp.activation_func is F.silu and not c.bias_activation_fusion
            and not getattr(c, "use_te_activation_func", False) and not c.add_bias_linear
            and getattr(c, "activation_func_clamp_value", None) is None)


def _norm_forward(self, x):
    """torch.nn.RMSNorm.forward through kernels/rmsnorm.py where exact; otherwise torch's own."""
    # torch's composite runs for an fp32 weight beside 16-bit inputs (megatron-core's local norm); with equal
    # dtypes torch runs a fused kernel of its own, left as it is
    if (_fusable(x) and self.weight is not None and self.weight.dtype == torch.float32 and self.eps is not None
            and len(self.normalized_shape) == 1):
        from ..kernels.rmsnorm import rms_norm_eager
        return rms_norm_eager(x, self.weight, self.eps)
    return type(self).forward(self, x)


def _rope(original):
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, *args, **kwargs):
        # megatron-core's signature (cp_group, and mla_rotary_interleaved in newer releases) passes through
        if (cu_seqlens is None and not args and not kwargs.get("mla_rotary_interleaved", False)
                and not config.apply_rope_fusion and not config.rotary_interleaved
                and not getattr(config, "multi_latent_attention", False)
                and _fusable(t) and freqs.dim() == 4 and freqs.shape[1] == 1 and freqs.shape[2] == 1
                and freqs.shape[0] == t.shape[0] and freqs.shape[-1] == t.shape[-1] and t.shape[-1] in _HEAD_DIMS
                and t.stride(-1) == 1):
            from ..kernels.rope import rope_eager
            cos = (torch.cos(freqs) * mscale).to(t.dtype)
            sin = (torch.sin(freqs) * mscale).to(t.dtype)
            return rope_eager(t, cos, sin)
        return original(t, freqs, config, cu_seqlens, mscale, *args, **kwargs)
    apply_rotary_pos_emb.exact_fusion = True
    return apply_rotary_pos_emb


@contextlib.contextmanager
def exact_fusions(model):
    """Within the block, model's MLPs and megatron-core's self-attention RoPE take the fused kernels where exact."""
    from megatron.core.transformer import attention as mattn
    from megatron.core.transformer.mlp import MLP
    patched = [m for m in model.modules() if type(m) is MLP and mlp_fusable(m)]
    for m in patched:
        m.forward = types.MethodType(_mlp_forward, m)
    norms = [m for m in model.modules() if type(m) is torch.nn.RMSNorm]
    for m in norms:
        m.forward = types.MethodType(_norm_forward, m)
    patched += norms
    original = mattn.apply_rotary_pos_emb
    if not getattr(original, "exact_fusion", False):
        mattn.apply_rotary_pos_emb = _rope(original)
    try:
        yield
    finally:
        mattn.apply_rotary_pos_emb = original
        for m in patched:
            del m.forward
