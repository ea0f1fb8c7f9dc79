"""The project's core attention for Megatron's local layer spec (no Transformer Engine), up to 32K tokens.

Without TE, megatron-core's local DotProductAttention materializes [b, heads, s, s] scores (137 GB per 32K
sample at GPT-OSS's 64 heads). This module has DotProductAttention's constructor and forward and computes:

- plain causal attention (no sinks, no window): torch scaled_dot_product_attention (flash kernels on GPU);
- GPT-OSS attention: learned per-head sinks (`softmax_type="learnable"`, the parameter
  `core_attention.softmax_offset` [heads / TP] that Bridge's GPT-OSS mapping loads; "off-by-one" is a fixed
  zero sink) and the sliding window of megatron-core's `window_size=(left, 0)` / `window_attn_skip_freq`
  (Bridge maps Hugging Face's window W to (W - 1, 0): key j is seen by query i when i - left <= j <= i).
  The math (sink via the log-sum-exp; FlexAttention on CUDA, a masked math path on CPU) is in
  sink_attention.py.

GQA runs without repeated K/V copies on GPU. Context parallel, packed sequences and KV-cache decoding are
refused with a message naming the fix.
"""
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide

from .sink_attention import sink_attention

_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def layer_window(window_size, window_attn_skip_freq, layer_number: int):
    """The left window of 1-based layer `layer_number` under megatron-core's window_size / window_attn_skip_freq
    (its is_layer_window_attention rule); None: full causal attention on this layer."""
    if not is_layer_window_attention(window_size, window_attn_skip_freq, layer_number):
        return None
    left, right = (int(x) for x in window_size)
    if right != 0:
        raise ValueError(f"window_size={tuple(window_size)}: causal GPT layers see no future keys; use (left, 0) "
                         "(Hugging Face's sliding_window W is (W - 1, 0))")
    return None if left < 0 else left  # TE's convention: -1 is an unbounded window


# --------------------------------------------------------------------------------------------- the module

class SDPAttention(MegatronModule):
    """Megatron core attention (DotProductAttention's constructor and forward): SDPA for plain causal layers,
    sink/window attention (FlexAttention on CUDA) for GPT-OSS layers. See the module docstring."""

    # Bridge's AutoMapping finds a module's TP layout from these when its class is not registered:
    # the sink [heads] is split over TP ranks per head (column-parallel), as DotProductAttention's.
    tensor_model_parallel = True
    partition_dim = 0
    supports_sinks_and_window = True  # megatron_kd.hf's layer spec keeps this class for GPT-OSS checkpoints

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(f"context_parallel_size={config.context_parallel_size}: the project's SDPA/"
                             "FlexAttention core attention has no context-parallel exchange; use parallel.cp=1 "
                             "(memory: recompute or more TP/EP), or, for a model without sinks or windows, "
                             "model.attention_backend=te in a TE container")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.tp_group = pg_collection.tp
        tp = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_type = getattr(config, "softmax_type", "vanilla")
        if self.softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"softmax_type={self.softmax_type!r}: use one of {SOFTMAX_TYPES}")
        self.window = layer_window(getattr(config, "window_size", None), getattr(config, "window_attn_skip_freq",
                                                                              None), max(1, layer_number))
        self.sink_path = self.softmax_type != "vanilla" or self.window is not None
        if self.sink_path:
            if attn_mask_type != AttnMaskType.causal:
                raise ValueError(f"attention sinks / sliding windows run with causal masks; got {attn_mask_type}")
            if self.dropout:
                raise ValueError(f"attention_dropout={self.dropout} with attention sinks / sliding windows: the "
                                 "FlexAttention path has no attention dropout; set it to 0 (GPT-OSS uses 0)")
            if getattr(config, "apply_query_key_layer_scaling", False):
                raise ValueError("apply_query_key_layer_scaling is not supported with attention sinks / windows")
        device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
        if self.softmax_type == "learnable":  # DotProductAttention's parameter: name, shape, dtype, init
            prm = torch.nn.Parameter(torch.empty(self.heads, device=device, dtype=config.params_dtype))
            tensor_parallel.set_tensor_model_parallel_attributes(prm, True, 0, 1)
            self.register_parameter("softmax_offset", prm)
            if config.perform_initialization:
                config.init_method(self.softmax_offset.data)
        elif self.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(self.heads, device=device,
                                                               dtype=config.params_dtype), persistent=False)
        else:
            self.softmax_offset = None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np * hn]."""
        if packed_seq_params is not None:
            raise ValueError("packed sequences need Transformer Engine attention (model.attention_backend=te)")
        if attention_bias is not None:
            raise ValueError("SDPA attention takes no attention_bias")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        sq, b = query.shape[0], query.shape[1]
        if self.sink_path:
            ctx = sink_attention(q, k, v, self.softmax_offset, self.window, self.scale)
            return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)
        gqa = {}
        if self.groups != self.heads:
            if _SDPA_GQA:
                gqa = {"enable_gqa": True}  # no repeated K/V copies
            else:
                rep = self.heads // self.groups
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # Causal layers ignore attention_mask, as TE's attention does (GPT layers are causal): the flash kernel
        # needs no [s, s] tensor, even when a caller builds one. Other mask types use the mask given.
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        mask = None if causal or attention_mask is None else ~attention_mask  # Megatron: True = masked
        if causal and q.shape[2] != k.shape[2]:
            raise ValueError("SDPA attention runs training/prefill (queries = keys); KV-cache decoding needs TE")
        p = self.dropout if self.training else 0.0
        if p > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                                     scale=self.scale, **gqa)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, **gqa)
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The learnable sink as a TP-sharded tensor (as DotProductAttention's)."""
        if self.softmax_type != "learnable":
            return {}
        state = self.state_dict(prefix="", keep_vars=True)
        dp_cp = (metadata or {}).get("dp_cp_group")
        if dp_cp is None:
            from megatron.core import parallel_state
            dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=dp_cp)
