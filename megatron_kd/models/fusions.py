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
import threading
import types
import warnings

import torch
import torch.nn.functional as F

_HALF = (torch.bfloat16, torch.float16)
_HEAD_DIMS = (16, 32, 64, 128, 256)  # the RoPE kernel takes half a head as one power-of-two block


def _fusable(t: torch.Tensor, kind: str) -> bool:
    return (t.is_cuda and t.dtype in _HALF and not torch.is_grad_enabled() and _triton()
            and _agrees(kind, t.device, t.dtype))


@functools.lru_cache(maxsize=None)
def _triton() -> bool:
    from ..kernels import fused_unavailable
    return fused_unavailable(cuda=True) is None  # without Triton megatron-core's own code runs


def _probe_values(n: int, device, dtype, g: torch.Generator) -> torch.Tensor:
    """n values over the ranges a forward meets, each kind at random places: normal values at several scales,
    subnormals (of fp16 and of bf16), zeros of both signs, and values past where expf overflows."""
    x = torch.randn(n, device=device, generator=g)
    scale = torch.tensor([0.0, 1e-39, 1e-6, 1e-3, 1.0, 30.0, 100.0], device=device)
    return (x * scale[torch.randint(0, len(scale), (n,), device=device, generator=g)]).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.isnan() & b.isnan()
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        ((a.view(torch.int16) == b.view(torch.int16)) | nan).all())


@functools.lru_cache(maxsize=None)
def _agrees(kind: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a kernel gives eager's bits on this device, dtype and torch, checked once on probe values: the
    kernels reproduce a particular torch's rounding order, so a torch that rounds elsewhere runs eager instead."""
    g = torch.Generator(device=device).manual_seed(0)  # its own generator: the model's RNG stream is untouched
    with torch.no_grad():
        if kind == "swiglu":
            from ..kernels.swiglu import swiglu_eager
            x = _probe_values(64 * 512, device, dtype, g).view(64, 512)
            a, b = torch.chunk(x, 2, dim=-1)
            ok = all(_same_bits(swiglu_eager(x, off), F.silu(a) * (b + off)) for off in (0.0, 1.0))
        elif kind == "rmsnorm":
            from ..kernels.rmsnorm import rms_norm_eager
            x = _probe_values(64 * 384, device, dtype, g).view(64, 384)
            w = 1 + 0.3 * torch.randn(384, device=device, generator=g)
            ok = _same_bits(rms_norm_eager(x, w, 1e-5), F.rms_norm(x, (384,), w, 1e-5))
        else:
            from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
            from ..kernels.rope import rope_eager
            t = _probe_values(32 * 2 * 3 * 64, device, dtype, g).view(32, 2, 3, 64)
            freqs = torch.randn(32, 1, 1, 64, device=device, generator=g) * 100
            ok = _same_bits(rope_eager(t, torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)),
                            _apply_rotary_pos_emb_bshd(t, freqs))
    if not ok:
        warnings.warn(f"the exact {kind} kernel does not give torch {torch.__version__}'s bits for {dtype} on "
                      f"{device}; that step runs unfused", stacklevel=2)
    return ok


def _mlp_forward(self, hidden_states, per_token_scale=None, **kwargs):
    """MLP.forward with the gate, bias-free SiLU case fused; other cases go to megatron-core's forward."""
    if per_token_scale is not None or not _fusable(hidden_states, "swiglu"):
        return type(self).forward(self, hidden_states, per_token_scale, **kwargs)
    from ..kernels.swiglu import swiglu_eager
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
    if (self.weight is not None and self.weight.dtype == torch.float32 and self.eps is not None
            and len(self.normalized_shape) == 1 and x.dim() >= 1 and x.shape[-1] == self.normalized_shape[0]
            and _fusable(x, "rmsnorm")):
        from ..kernels.rmsnorm import rms_norm_eager
        return rms_norm_eager(x, self.weight, self.eps)
    return type(self).forward(self, x)


def _rope(original):
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, *args, **kwargs):
        # megatron-core's signature (cp_group, and mla_rotary_interleaved in newer releases) passes through
        if (cu_seqlens is None and not args and not kwargs.get("mla_rotary_interleaved", False)
                and not config.apply_rope_fusion and not config.rotary_interleaved
                and not getattr(config, "multi_latent_attention", False)
                and freqs.dim() == 4 and freqs.shape[1] == 1 and freqs.shape[2] == 1
                and freqs.shape[0] == t.shape[0] and freqs.shape[-1] == t.shape[-1] and t.shape[-1] in _HEAD_DIMS
                and t.stride(-1) == 1 and _fusable(t, "rope")):
            from ..kernels.rope import rope_eager
            cos = (torch.cos(freqs) * mscale).to(t.dtype)
            sin = (torch.sin(freqs) * mscale).to(t.dtype)
            return rope_eager(t, cos, sin)
        return original(t, freqs, config, cu_seqlens, mscale, *args, **kwargs)
    apply_rotary_pos_emb.exact_fusion = True
    return apply_rotary_pos_emb


# megatron-core's apply_rotary_pos_emb is one module global for every model in the process: it is replaced while
# at least one exact_fusions block is open (blocks may nest, overlap, or run on several threads) and restored when
# the last one closes
_rope_lock = threading.Lock()
_rope_state = {"users": 0, "original": None, "wrapper": None}


def _rope_enter(mattn) -> None:
    with _rope_lock:
        if _rope_state["users"] == 0:
            _rope_state["original"] = mattn.apply_rotary_pos_emb
            _rope_state["wrapper"] = _rope(mattn.apply_rotary_pos_emb)
            mattn.apply_rotary_pos_emb = _rope_state["wrapper"]
        _rope_state["users"] += 1


def _rope_exit(mattn) -> None:
    with _rope_lock:
        _rope_state["users"] -= 1
        if _rope_state["users"] == 0:
            if mattn.apply_rotary_pos_emb is _rope_state["wrapper"]:  # else someone replaced it since: theirs stays
                mattn.apply_rotary_pos_emb = _rope_state["original"]
            _rope_state["original"] = _rope_state["wrapper"] = None


@contextlib.contextmanager
def exact_fusions(model):
    """Within the block, model's MLPs and megatron-core's self-attention RoPE take the fused kernels where exact.

    A module whose forward is already overridden on the instance (by an enclosing block, or by its owner) is left
    as it is, and only the overrides this block made are removed when it closes."""
    from megatron.core.transformer import attention as mattn
    from megatron.core.transformer.mlp import MLP
    mine = []
    for m in model.modules():
        if "forward" in vars(m):
            continue
        if type(m) is MLP and mlp_fusable(m):
            m.forward = types.MethodType(_mlp_forward, m)
        elif type(m) is torch.nn.RMSNorm:
            m.forward = types.MethodType(_norm_forward, m)
        else:
            continue
        mine.append(m)
    _rope_enter(mattn)
    try:
        yield
    finally:
        _rope_exit(mattn)
        for m in mine:
            del m.forward
