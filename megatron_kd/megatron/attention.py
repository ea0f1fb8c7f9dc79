"""A core-attention module on torch's scaled_dot_product_attention, for Megatron's local layer spec.

Without Transformer Engine, Megatron's local DotProductAttention materializes [b, heads, s, s] scores, which
does not fit at 32K tokens. torch SDPA dispatches to its flash / memory-efficient kernels on GPU (and a
fused CPU kernel), so long sequences train without TE. Same constructor and forward as DotProductAttention.
"""
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


class SDPAttention(MegatronModule):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("context parallel needs Transformer Engine attention (model.attention_backend=te); "
                             "SDPA attention runs with parallel.cp=1")
        if getattr(config, "softmax_type", "vanilla") != "vanilla" or getattr(config, "window_size", None):
            raise ValueError("SDPA attention supports plain causal softmax attention only (no attention sinks or "
                             "sliding windows); use model.attention_backend=te for this model")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np * hn]."""
        if packed_seq_params is not None:
            raise ValueError("packed sequences need Transformer Engine attention (model.attention_backend=te)")
        if attention_bias is not None:
            raise ValueError("SDPA attention takes no attention_bias")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
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
        sq, b = query.shape[0], query.shape[1]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

