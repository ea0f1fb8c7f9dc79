"""The frozen teacher of online mode, and the Megatron-Core GPTModel teacher of the cache builder.

Online mode runs the teacher GPTModel beside the student on the same TP group and takes its top-K with
`topk_from_hidden`, the vocab-parallel top-K the cache builder uses, so online and offline (cache) targets
are the same numbers up to the cache's log-prob encoding.
"""
import contextlib
import hashlib
import re

import torch

from ..cache.hashing import config_hash
from ..cache.reader import fp8_precision
from .pipeline import PipelineStage, global_layer_names
from .protocol import TeacherOutput, tokens_to
from ..parallel.comm import all_reduce_sum, group_rank, group_size
from ..parallel.sequence import gather_sequence
from ..parallel.topk import topk_from_hidden
from ..checkpoint import store as ckpt
from ..models.hook import forward_with_head, output_layer_replaced, output_layout
from ..models.builder import build_gpt, layer_backend, unwrap  # noqa: F401  (layer_backend re-exported)
from ..models.fusions import exact_fusions


class OnlineTeacher:
    def __init__(self, model, top_k: int, valid_vocab_size: int, temperature: float = 1.0, chunk_size=None):
        self.model, self.top_k, self.valid_vocab_size = model, int(top_k), int(valid_vocab_size)
        self.temperature, self.chunk_size = float(temperature), chunk_size
        freeze(model)

    @torch.no_grad()
    def topk(self, batch: dict):
        """(topk_ids int64 [b, s, K], topk_logprobs float32 [b, s, K]) for the batch's tokens."""
        gpt = unwrap(self.model)
        group, sp = output_layout(gpt)
        out = {}

        def head(hidden, weight):
            if sp:
                hidden = gather_sequence(hidden, group)
            s, b, h = hidden.shape
            ids, lp = topk_from_hidden(hidden.reshape(s * b, h), weight, self.top_k, group, self.chunk_size,
                                       self.temperature, valid_vocab_size=self.valid_vocab_size)
            out["ids"], out["lp"] = ids.reshape(s, b, -1), lp.reshape(s, b, -1)
            return hidden.new_empty((s, b, 0))

        forward_with_head(self.model, head, batch["tokens"], batch["position_ids"], batch.get("attention_mask"))
        return out["ids"].transpose(0, 1).contiguous(), out["lp"].transpose(0, 1).contiguous()


def freeze(model) -> None:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)


def build_teacher(r, vocab_size: int, parallel=None, names=None):
    """The recipe's teacher GPTModel on this rank (layout `parallel`, default the recipe's), frozen: teacher.hf_path's
    architecture and weights through Megatron-Bridge, else the recipe's architecture with teacher.load's weights
    (random when unset). Online mode, kd.build_cache and `cache build` all build it here. names: (the checkpoint,
    the setting that chooses its layer spec with {} for the value) as the user gave them, for the load's errors;
    default teacher.load's."""
    p = parallel or r.parallel
    if r.teacher.hf_path:
        from ..models.builder import build_hf_chunks
        m = build_hf_chunks(r.teacher, p, r.data.seq_length, r.train.precision)[0][0]
    else:
        what, setting = names or (f"teacher.load={r.teacher.load}", "teacher.attention_backend={}")
        if r.teacher.load:  # before the build: a checkpoint of another layer spec cannot load into it
            ckpt.check_spec(r.teacher.load, r.teacher, what, setting)
        m = build_gpt(r.teacher, p, vocab_size, r.data.seq_length, r.train.precision)
        if r.teacher.load:
            ckpt.load_spec_weights(r.teacher.load, [m], what, setting)
    freeze(m)
    return m


def cache_teacher(r, vocab_size: int, parallel=None, names=None):
    """The cache builder's teacher of recipe r: build_teacher's model on this rank's TP shard."""
    from megatron.core import parallel_state as ps
    model = build_teacher(r, vocab_size, parallel, names)
    return MegatronTeacher(model, vocab_size, name=r.teacher.name, tp_group=ps.get_tensor_model_parallel_group())


def start_cache_teacher(r, vocab_size: int, names=None):
    """The one teacher setup of a cache build outside `megatron-kd train` (the recipe factory of `cache build`,
    a mkd: teacher): this job's process group, Megatron's groups at the recipe's TP unpipelined (the builder
    runs the teacher whole; other ranks split the samples), the seed, then cache_teacher."""
    import dataclasses
    from ..runtime.dist import init_model_parallel, init_process_group, set_seed, use_cuda
    cuda = use_cuda(r.train.device)
    init_process_group(cuda)
    p = dataclasses.replace(r.parallel, pp=1, cp=1)
    init_model_parallel(p, cuda)
    set_seed(r.train.seed)
    return cache_teacher(r, vocab_size, parallel=p, names=names)


# Fields of a TransformerConfig that define the function a GPT computes. Parallel layout fields are left out
# so that the same teacher hashes alike at any TP size.
_CONFIG_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                  "kv_channels", "normalization", "layernorm_epsilon", "layernorm_zero_centered_gamma",
                  "gated_linear_unit", "activation_func", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
                  "num_moe_experts", "moe_router_topk", "rotary_interleaved", "apply_residual_connection_post_layernorm",
                  "params_dtype", "bf16", "fp16", "softmax_scale", "window_size", "attention_softmax_in_fp32")


def _plain(v):
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return getattr(v, "__name__", None) or str(v)


def megatron_weights_hash(model, tp_group, pp_group=None) -> str:
    """A TP/PP/EP-layout-invariant fingerprint: exact int64 sums of each tensor's bit patterns (and their squares).

    Integer sums do not depend on summation order, so TP shards summed over the TP group give the TP=1 value.
    Zero padding rows of the vocabulary add nothing. Under PP each stage's tensors are named by global layer
    number and the stages' entries are gathered, so PP=2 gives the PP=1 value; the last stage's copy of tied
    embeddings is left out (the first stage holds the original). MoE experts: shards summed over the expert
    tensor-parallel group, each expert named by its global number and the expert-parallel ranks' entries gathered
    (same-named entries, a grouped-GEMM's block of local experts, added), so EP=2 gives the EP=1 value.
    Not cryptographic: it tells checkpoints apart.
    """
    names = global_layer_names(model) if hasattr(model, "decoder") else {}
    skip_tied_copy = (getattr(model, "share_embeddings_and_output_weights", False)
                      and not getattr(model, "pre_process", True))
    experts = _ExpertLayout(model)
    entries, expert_entries = [], {}
    for name, p in model.named_parameters():
        if skip_tied_copy and name.endswith("output_layer.weight"):
            continue
        t = p.detach()
        bits = t.view(torch.int16 if t.element_size() == 2 else torch.int32).to(torch.int64).reshape(-1)
        sums = torch.stack([bits.sum(), (bits * bits).sum()])
        expert = experts.is_expert(name)
        if getattr(p, "tensor_model_parallel", False):
            sums = all_reduce_sum(sums, experts.tp_group if expert else tp_group)
        key = (names.get(name, name), str(t.dtype))
        if expert:
            key = (experts.global_name(key[0]), key[1])
            expert_entries[key] = (int(sums[0].item()), int(sums[1].item()))
        else:
            entries.append((*key, int(sums[0].item()), int(sums[1].item())))
    entries += experts.gather(expert_entries)
    if group_size(pp_group) > 1:
        gathered = [None] * group_size(pp_group)
        torch.distributed.all_gather_object(gathered, entries, group=pp_group)
        entries = [e for stage in gathered for e in stage]
    h = hashlib.sha256()
    for name, dtype, s1, s2 in sorted(entries, key=lambda e: e[0]):
        h.update(f"{name}:{dtype}:{s1}:{s2};".encode())
    return h.hexdigest()[:16]


class _ExpertLayout:
    """Where a model's MoE experts live: their tensor-parallel group and, under expert parallelism, this rank's
    share of them (megatron-core numbers a rank's experts from 0: `local_experts.<i>.` in SequentialMLP,
    `weight<i>` / `bias<i>` in TEGroupedMLP; GroupedMLP holds them in one tensor)."""
    _SEQUENTIAL = re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)")
    _TE_GROUPED = re.compile(r"(\.experts\.linear_fc\d\.(?:weight|bias))(\d+)$")

    def __init__(self, model):
        self.tp_group, self.ep_group, self.first, self.spread = None, None, 0, False
        n = getattr(getattr(model, "config", None), "num_moe_experts", None)
        if not n:
            return
        from megatron.core import parallel_state as ps
        if not ps.model_parallel_is_initialized():
            return
        self.tp_group = ps.get_expert_tensor_parallel_group(check_initialized=False)
        ep = ps.get_expert_model_parallel_world_size()
        if ep > 1:
            self.spread, self.ep_group = True, ps.get_expert_model_parallel_group()
            self.first = ps.get_expert_model_parallel_rank() * (n // ep)

    @staticmethod
    def is_expert(name: str) -> bool:
        return ".experts." in name

    def global_name(self, name: str) -> str:
        if not self.first:
            return name
        name = self._SEQUENTIAL.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + self.first}{m.group(3)}", name)
        return self._TE_GROUPED.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + self.first}", name)

    def gather(self, entries: dict) -> list:
        """[(name, dtype, s1, s2)] of every expert of the model: this rank's entries, with those of the other
        expert-parallel ranks when the experts are spread."""
        if self.spread:
            parts = [None] * group_size(self.ep_group)
            torch.distributed.all_gather_object(parts, entries, group=self.ep_group)
            entries = {}
            for part in parts:
                for key, (s1, s2) in part.items():
                    a, b = entries.get(key, (0, 0))
                    entries[key] = (a + s1, b + s2)
        return [(*key, s1, s2) for key, (s1, s2) in entries.items()]


def _megatron_tp_group():
    """Megatron's tensor-parallel group when parallel_state is initialized with TP > 1, else None."""
    try:
        from megatron.core import parallel_state as ps
        if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
            return ps.get_tensor_model_parallel_group()
    except (ImportError, AssertionError, RuntimeError):
        pass
    return None


def _expert_parallel_size() -> int:
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        return 1
    return ps.get_expert_model_parallel_world_size()


class MegatronTeacher:
    """A Megatron-Core GPTModel as a teacher: hidden states + its output-layer shard, at any TP and PP.

    The output layer is bypassed during the forward, so no [s, b, V/tp] logits tensor is ever made.
    vocab_size is the tokenizer's (unpadded) size; the model's padded rows never enter the top-K.

    Pipeline parallel: pass this rank's stage (a GPTModel built with pre_process / post_process for its stage after
    parallel_state.initialize_model_parallel(..., pipeline_model_parallel_size=pp)); the stage-to-stage flow is
    megatron_kd.teacher.pipeline's plain send/recv. pp_group defaults to Megatron's pipeline group when the model is
    a stage (pre_process or post_process False). On ranks without the last stage `__call__` returns None
    (`is_last_stage` False): only last-stage ranks compute the top-K and write.
    """

    def __init__(self, model, vocab_size: int, *, name: str = "megatron-gpt", tp_group=None, pp_group=None,
                 exact_fusions: bool = True):
        if isinstance(model, (list, tuple)):
            if len(model) != 1:
                raise ValueError("MegatronTeacher takes one model chunk per rank; virtual pipeline stages "
                                 f"(got {len(model)} chunks) are not supported: build the teacher with vpp=None")
            model = model[0]
        if tp_group is None:  # a TP-sharded model without its group would mislabel ids and race on writes
            tp_group = _megatron_tp_group()
        self.model, self.vocab_size, self.name, self.tp_group = model, int(vocab_size), name, tp_group
        self.model.eval()
        is_stage = not (getattr(model, "pre_process", True) and getattr(model, "post_process", True))
        if pp_group is None and is_stage:
            from megatron.core import parallel_state as ps
            pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_group = pp_group if group_size(pp_group) > 1 else None
        if self.pp_group is None and is_stage:
            raise ValueError("the model is a pipeline stage (pre_process/post_process False) but the pipeline "
                             "group has one rank; initialize Megatron with pipeline_model_parallel_size > 1")
        self.pipeline = PipelineStage(model, self.pp_group) if self.pp_group is not None else None
        # The SDPA, sink and TE core attentions apply causality themselves and ignore a mask; only megatron-core's
        # own DotProductAttention reads one. Without it no [s, s] mask is made (16 GiB per call at 128K tokens).
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        self._needs_mask = any(isinstance(mod, DotProductAttention) for mod in model.modules())
        self.is_last_stage = self.pipeline is None or self.pipeline.is_last
        # experts spread over ranks: each forward is a collective across data-parallel ranks (build.py's _Lockstep)
        self.expert_parallel = bool(getattr(model.config, "num_moe_experts", None)) and _expert_parallel_size() > 1
        # The forward runs with models/fusions.py's kernels where they give eager's bits (SwiGLU, RoPE, RMSNorm):
        # the same hidden states in fewer passes over memory. False runs megatron-core's modules as they are.
        self.exact_fusions = exact_fusions

    def identity(self) -> dict:
        """Same value at any TP/PP layout of the same weights. Collective: every rank of the model calls it."""
        cfg = {k: _plain(getattr(self.model.config, k, None)) for k in _CONFIG_FIELDS}
        cfg["position_embedding_type"] = getattr(self.model, "position_embedding_type", None)
        cfg["share_embeddings_and_output_weights"] = getattr(self.model, "share_embeddings_and_output_weights", None)
        ident = {"name": self.name, "config_hash": config_hash(cfg),
                 "weights_hash": megatron_weights_hash(self.model, self.tp_group, self.pp_group),
                 "backend": layer_backend(self.model)}
        fp8 = getattr(self.model.config, "fp8", None)
        if fp8 and "+fp8" in ident["backend"]:  # only then: a bf16 teacher's identity (and cache) stays as it was
            ident["fp8"] = fp8_precision(fp8, getattr(self.model.config, "fp8_recipe", None))
        return ident

    def flush(self) -> None:
        """Wait for this stage's outstanding sends (the builder calls it after its last micro-batch)."""
        if self.pipeline is not None:
            self.pipeline.flush()

    def _output_weight(self):
        m = self.model
        if m.share_embeddings_and_output_weights:
            return m.shared_embedding_or_output_weight()
        return m.output_layer.weight

    def _hidden_only(self, box):
        """The output layer records the hidden states (gathered under sequence parallel) instead of logits."""
        layer = self.model.output_layer
        tp = self.tp_group

        def head(hidden, weight):
            if getattr(layer, "sequence_parallel", False) and group_size(tp) > 1:
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
                hidden = gather_from_sequence_parallel_region(hidden, group=tp)
            box.append(hidden)
            return hidden

        return output_layer_replaced(self.model, head)

    def _hidden_shape(self, b, s):
        cfg = self.model.config
        if getattr(cfg, "sequence_parallel", False):
            s //= group_size(self.tp_group)
        dtype = getattr(cfg, "pipeline_dtype", None) or cfg.params_dtype
        return (s, b, cfg.hidden_size), dtype

    @torch.no_grad()
    def __call__(self, tokens) -> TeacherOutput | None:
        tokens = tokens_to(tokens, next(self.model.parameters()).device)
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        mask = None
        if self._needs_mask:
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=tokens.device), diagonal=1)[None, None]
        with exact_fusions(self.model) if self.exact_fusions else contextlib.nullcontext():
            return self._forward(tokens, pos, mask)

    def _forward(self, tokens, pos, mask) -> TeacherOutput | None:
        b, s = tokens.shape
        box = []
        if self.pipeline is None:
            with self._hidden_only(box):
                self.model(tokens, pos, mask)
        elif self.pipeline.is_last:
            shape, dtype = self._hidden_shape(b, s)
            with self._hidden_only(box):
                self.pipeline.run(lambda: self.model(tokens, pos, mask), shape, dtype)
        else:
            shape, dtype = self._hidden_shape(b, s)
            self.pipeline.run(lambda: self.model(tokens, pos, mask), shape, dtype)
            return None  # the hidden states went on to the next stage
        hidden = box[0].transpose(0, 1)  # [s, b, H] -> [b, s, H]
        w = self._output_weight()
        return TeacherOutput(hidden=hidden, weight=w, vocab_start_index=group_rank(self.tp_group) * w.shape[0])
