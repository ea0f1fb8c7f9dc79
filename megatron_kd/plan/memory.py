"""Per-GPU peak memory of a Megatron-Core KD training step: the model behind `megatron-kd plan`.

What one rank allocates (torch.cuda.max_memory_allocated; the CUDA context and allocator slack come on top,
see RESERVE_GIB):

  static     weights (bf16) + Megatron DDP grad buffer (fp32 main grads, or bf16) + optimizer state (fp32 main
             params + Adam m, v; the distributed optimizer shards dense params over DP x CP and expert params
             over expert-DP) + teacher weights (online) + the top-K cache batches resident on the GPU; under
             FP8, Transformer Engine's cached FP8 copies of the linear weights.
  activations what the forward keeps for backward: per layer either the checkpointed input (full recompute)
             or everything autograd saves (layer_activations: megatron-core's local spec with SDPA;
             te_layer_activations: Transformer Engine's spec, bf16 or FP8), times the micro-batches in flight on the
             stage (1F1B: pp - stage); plus the working set of the one layer being recomputed / differentiated.
  loss       our chunked/fused KL: one logit chunk plus O(tokens x (H + K)) buffers and, unless the fused
             loss writes the weight gradient straight into Megatron's main_grad, an fp32 [V/tp, H] gradient;
             dense: whole [tokens, V/tp] fp32 logit matrices.
  transients the optimizer step (torch's foreach AdamW holds one fp32 temporary per param group; bf16 grad
             buffers are copied to fp32 for the step), bf16 weight gradients between autograd and main_grad.

The peak is the largest of four phases: end of forward (loss), backward (recomputed layer), end of backward
(embedding gradient) and optimizer step. Every term is a closed formula of the shape and layout; the
activation terms name the tensors they count (tests/plan/test_plan.py checks the local spec's against autograd
on CPU; TE runs on GPUs only, and tests/plan/test_plan_vs_measured.py checks its terms against H200 peaks).
"""
from dataclasses import dataclass, field, replace

from .. import quant_formats
from ..parallel.limits import LOGITS_PER_CHUNK
from .attention_bytes import attention_activation_bytes
from ..recipe.targets import MODES, TargetSource
from ..rules import DEFAULT_TOP_K, padded_vocab_size
from .shapes import Layout, ModelShape, param_counts

GIB = float(1 << 30)
RESERVE_GIB = 3.0          # CUDA context, NCCL buffers, allocator rounding: not in max_memory_allocated
H200_GIB = 139.8           # usable HBM of one H200 (torch.cuda.mem_get_info total)
H100_GIB = 79.1            # usable HBM of one H100 80GB (torch.cuda.mem_get_info total)
# The GPU kinds `megatron-kd plan --gpu` knows: name, usable GiB. A recipe made for one says so in its name
# (..._1xh100, ..._8xh200), and plan checks it against that kind unless told another.
GPU_KINDS = {"h100": ("H100 80GB", H100_GIB), "h200": ("H200 141GB", H200_GIB)}

RECOMPUTE = ("full", "selective", "none")
SPECS = ("sdpa", "te")     # megatron-core's local layers with torch SDPA | Transformer Engine's layers


def loss_impls() -> tuple:
    """The loss impls the planner models: kd.impl's names (loss.options.IMPLS) but auto. Imported when asked, so
    `megatron-kd plan --help` loads no torch."""
    from ..loss.options import IMPLS
    return tuple(i for i in IMPLS if i != "auto")


@dataclass(frozen=True)
class Training:
    seq_len: int = 8192
    micro_batch: int = 1
    num_microbatches: int = 1          # micro-batches per step on each DP rank (PP in-flight bound)
    recompute: str = "full"            # full | selective (core attention) | none
    recompute_layers: int | None = None  # full: layers per stage recomputed (None: all), the rest keep activations
    grad_fp32: bool = True             # DDP grad buffer in fp32 (grad_reduce_in_fp32); False: bf16
    distributed_optimizer: bool = True
    optimizer: str = "adam"            # adam (Megatron's) | lean_adam (bf16 grads, remainder + m, v unsharded)
    moment_bytes: tuple = (2, 4)       # lean_adam: bytes of exp_avg, exp_avg_sq
    adam_impl: str = "fused"           # fused | foreach (torch's CUDA default) | for_loop
    loss: str = "fused"                # our impls (loss_impls())
    main_grad_fusion: bool = True      # fused loss accumulates the output weight grad into main_grad
    mode: str = "offline"              # offline (cache) | online (teacher in memory) | ce
    topk: int = DEFAULT_TOP_K
    teacher: ModelShape | None = None  # online: same TP/PP/EP layout as the student
    teacher_loss: str = "topk"         # online: "topk" (teacher top-K chunk by chunk + our loss) | "dense"
    cache_buffers: int = 2             # top-K batches resident on the GPU (current + prefetched)
    swiglu_fusion: bool = False        # Megatron's bias_activation_fusion (torch.compile'd SwiGLU)
    fused_norm: bool = True            # CUDA's fused RMSNorm (False: torch's composite CPU path, for CPU checks)
    quant: str = "none"                # quant.format (quant_formats/): ModelOpt's quantizers on every linear but the
                                       # output layer
    spec: str = "sdpa"                 # the layers: sdpa (local spec, torch SDPA) | te (Transformer Engine's spec)
    fp8: str | None = None             # te: FP8 scaling recipe of TE's linears (model.fp8_recipe); None: bf16
    fp8_attention: bool = False        # te + fp8: TE's FP8 core attention too (model.fp8_attention)
    te_attention: bool = True          # te: TE's core attention; False: megatron-kd's sink / window attention

    @property
    def targets(self) -> TargetSource:
        """Where the loss's targets come from (the planner's questions go to it, not to the mode's name)."""
        return TargetSource(self.mode)

    def check(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}; use one of {RECOMPUTE}")
        if self.loss not in loss_impls():
            raise ValueError(f"loss={self.loss!r}; use one of {loss_impls()}")
        if not self.targets.known:
            raise ValueError(f"mode={self.mode!r}; use one of {MODES}")
        if self.targets.teacher_each_step and self.teacher is None:
            raise ValueError("mode='online' needs a teacher shape")
        if self.adam_impl not in ("fused", "foreach", "for_loop"):
            raise ValueError(f"adam_impl={self.adam_impl!r}; use fused, foreach or for_loop")
        if self.seq_len < 1 or self.micro_batch < 1 or self.num_microbatches < 1:
            raise ValueError("seq_len, micro_batch and num_microbatches must be >= 1")
        if self.spec not in SPECS:
            raise ValueError(f"spec={self.spec!r}; use one of {SPECS}")
        if quant_formats.unknown_problem(self.quant, "quant"):
            raise ValueError(quant_formats.unknown_problem(self.quant, "quant"))
        if self.fp8 is not None:
            from ..recipe.schema import FP8_RECIPES  # here: the schema imports torch, `plan --help` does not
            if self.spec != "te":
                raise ValueError(f"fp8={self.fp8!r}: FP8 runs in Transformer Engine's layers only (spec='te')")
            if self.fp8 not in FP8_RECIPES:
                raise ValueError(f"fp8={self.fp8!r}; use one of {FP8_RECIPES} (None: bf16)")
        if self.fp8_attention and self.fp8 is None:
            raise ValueError("fp8_attention needs FP8 layers (fp8=RECIPE)")

    @property
    def layers_name(self) -> str:
        """The layers this step runs on, in words (the plan's notes say which spec it assumed)."""
        if self.spec != "te":
            return "local spec, SDPA"
        name = "TE spec" + ("" if self.te_attention else " with megatron-kd's core attention")
        return name + (f", FP8 {self.fp8}" + (" + FP8 attention" if self.fp8_attention else "") if self.fp8
                       else ", bf16")


@dataclass
class Item:
    group: str
    name: str
    bytes: float
    note: str = ""


@dataclass
class Plan:
    shape: ModelShape
    layout: Layout
    training: Training
    stage: int
    items: list = field(default_factory=list)
    phases: dict = field(default_factory=dict)      # phase -> bytes
    params_local: int = 0
    tokens_local: int = 0

    @property
    def peak_bytes(self) -> float:
        return max(self.phases.values())

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def group_bytes(self, group: str) -> float:
        return sum(i.bytes for i in self.items if i.group == group)

    def get(self, name: str) -> float:
        return sum(i.bytes for i in self.items if i.name == name)

    def fits(self, gpu_gib: float = H200_GIB, reserve_gib: float = RESERVE_GIB) -> bool:
        return self.peak_gib + reserve_gib <= gpu_gib

    def as_dict(self) -> dict:
        return dict(shape=self.shape.as_dict(), layout=vars(self.layout) | dict(etp=self.layout.expert_tp),
                    training={k: (v.name if isinstance(v, ModelShape) else v) for k, v in vars(self.training).items()},
                    stage=self.stage, params_local=self.params_local, tokens_local=self.tokens_local,
                    items=[dict(group=i.group, name=i.name, gib=i.bytes / GIB, note=i.note) for i in self.items],
                    phases_gib={k: v / GIB for k, v in self.phases.items()}, peak_gib=self.peak_gib,
                    peak_phase=self.peak_phase)


# ----------------------------------------------------------------------------------------------- activations

def tokens_per_rank(tr: Training, lay: Layout) -> int:
    """Tokens of one micro-batch on one rank (context parallel splits the sequence)."""
    return tr.micro_batch * tr.seq_len // lay.cp


def layer_activations(shape: ModelShape, lay: Layout, T: int, moe: bool, b: int = 2, micro_batch: int = 1,
                      swiglu_fusion: bool = False, fused_norm: bool = True) -> dict:
    """Bytes autograd keeps for backward in one Megatron local-spec layer with SDPA attention, no recompute.

    T = tokens of the micro-batch on this rank; the norms and residuals see T / tp under sequence
    parallelism (Megatron's linears save the sequence shard and re-gather it in backward). Every entry is a
    tensor that megatron-core 0.16/0.19 + torch keep (checked on CPU by tests/plan/test_plan.py):
    RMSNorm: CUDA's fused kernel keeps its bf16 input and an fp32 rstd (fused_norm=False: the composite CPU
    path, two fp32 copies); SDPA: q, k (new after RoPE), v (a view that keeps the whole qkv output alive),
    output and fp32 log-sum-exp; the output reshape for linear_proj is a view when micro_batch == 1;
    RoPE's bf16 cos/sin for q and k; unfused SwiGLU keeps fc1's output (the gate is a view), silu(gate),
    (linear + glu_linear_offset), and the product (fc2's input); MoE experts also keep the product before
    the routing-prob scale.
    """
    t, h = lay.tp, shape.hidden_size
    ts = T // t if lay.sp else T
    norm = (b * ts * h + 4 * ts) if fused_norm else 2 * 4 * ts * h + 4 * ts
    a = {"norm1 input (residual)": norm, "qkv input (norm1 out)": b * ts * h}
    a |= sdpa_attention_activations(shape, lay, T, b, micro_batch)
    return a | mlp_activations(shape, lay, T, moe, norm, b=b, swiglu_fusion=swiglu_fusion)


def sdpa_attention_activations(shape: ModelShape, lay: Layout, T: int, b: int = 2, micro_batch: int = 1) -> dict:
    """The attention half of layer_activations from the qkv output on: megatron-core's unfused RoPE and torch
    SDPA (or megatron-kd's sink / window attention, attention_bytes.py), and linear_proj's input."""
    d, s = shape.kv_channels, T // max(1, micro_batch)
    nq, nkv = shape.num_attention_heads // lay.tp, shape.num_query_groups // lay.tp
    a = {
        "qkv output (v is a view of it)": b * T * (nq + 2 * nkv) * d,
        "q, k after RoPE": b * T * (nq + nkv) * d,
        "RoPE cos/sin": 4 * b * s * d,
        **attention_activation_bytes(T, nq, nkv, d, sink=shape.attention_sinks, window=None, elem=b),
    }
    if micro_batch > 1:
        a["proj input"] = b * T * nq * d
    return a


def mlp_activations(shape: ModelShape, lay: Layout, T: int, moe: bool, norm: float, b: int = 2,
                    swiglu_fusion: bool = False, x: float | None = None) -> dict:
    """What one layer's MLP half keeps for backward: the pre-MLP norm (`norm`: its saved input and statistics),
    the norm's output, which fc1 keeps (`x` bytes per element: the bf16 output, or the FP8 copy a TE linear keeps),
    and the dense MLP or MoE tensors of layer_activations. fc2 of a dense MLP keeps its input in `x` bytes too
    (the bf16 product, or TE's FP8 copy, when nobody else keeps the product)."""
    t, h = lay.tp, shape.hidden_size
    ts = T // t if lay.sp else T
    x = b if x is None else x
    a = {"norm2 input (residual)": norm, "mlp input (norm2 out)": x * ts * h}
    gated = shape.gated_mlp
    if not moe:
        f = shape.ffn_hidden_size // t
        a["fc1 output"] = b * T * (2 if gated else 1) * f
        if gated and not swiglu_fusion:
            a["silu(gate), linear + offset"] = 2 * b * T * f
        a["fc2 input"] = x * T * f
        return a
    fe = shape.moe_ffn_hidden_size // lay.expert_tp
    R = routed_tokens(shape, lay, T)
    a["router (logits, probs, routing map)"] = ts * shape.num_moe_experts * 7 + ts * shape.moe_router_topk * 20 + 2 * R
    a["expert inputs (dispatched)"] = b * R * h
    a["expert fc1 outputs"] = b * R * (2 if gated else 1) * fe
    fusion = swiglu_fusion and gated and not shape.add_bias_linear
    if gated and not fusion:
        a["expert silu(gate), linear + offset"] = 2 * b * R * fe
    if not fusion:
        a["expert act outputs (before probs)"] = b * R * fe
    a["expert fc2 inputs (x probs)"] = b * R * fe
    if shape.moe_shared_expert_intermediate_size:
        fs = shape.moe_shared_expert_intermediate_size // t
        a["shared expert"] = b * T * fs * ((2 + 2 + 1) if gated else 2)
    return a


def fp8_element_bytes(recipe: str, weight: bool = False) -> float:
    """Bytes per element of one FP8 copy Transformer Engine makes under `recipe`, its scales included. Per-tensor
    recipes (tensorwise = current scaling, delayed) keep one fp32 scale per tensor (not counted); blockwise keeps
    an fp32 scale per 1 x 128 block of an activation and per 128 x 128 block of a weight; mxfp8 an 8-bit scale per
    32 elements."""
    if recipe == "blockwise":
        return 1 + 4 / (128 * 128 if weight else 128)
    if recipe == "mxfp8":
        return 1 + 1 / 32
    return 1.0


def te_layer_activations(shape: ModelShape, lay: Layout, T: int, moe: bool, b: int = 2, micro_batch: int = 1,
                         swiglu_fusion: bool = False, fp8: str | None = None, fp8_attention: bool = False,
                         te_attention: bool = True, selective: bool = False) -> dict:
    """Bytes autograd keeps for backward in one layer of megatron-core's Transformer Engine spec
    (get_gpt_layer_with_transformer_engine_spec; megatron-core 0.19, TE 2.20), no recompute; fp8: the FP8
    recipe of TE's linears (None: bf16). What each keeps, from their source:

    - The norms are fused into the linear after them (TELayerNormColumnParallelLinear: linear_qkv, and linear_fc1
      of a dense MLP). It keeps its bf16 input (the residual), an fp32 rstd (LayerNorm: and the mean) and the norm's
      output: bf16, or under FP8 the column-wise (transposed) FP8 copy its GEMM's weight gradient reads (under
      sequence parallelism the row-wise shard it gathers again), which the norm kernel writes directly (the bf16
      output is never made).
    - TE's linears keep their input: bf16, the tensor they were given (no copy); FP8, a column-wise FP8 copy. So
      fc2 keeps the SwiGLU product in FP8 and the bf16 product is freed (the multiply keeps only its operands).
      linear_proj's input is the attention output, which the attention keeps anyway; megatron-core sets
      save_original_input on linear_proj for every FP8 recipe but delayed, so only delayed keeps an FP8 copy too.
    - RoPE is TE's fused kernel (apply_rope_fusion): its backward needs only the frequencies all layers share, so
      no per-layer cos/sin.
    - TE's core attention (cuDNN fused attention) keeps q, k, v, its output and fp32 softmax stats [heads, T]. q
      and k are new tensors (fused RoPE), v a strided view of the qkv output; that is no packed layout TE knows,
      so its get_qkv_layout makes all three contiguous and keeps a copy of v: the qkv output itself is freed
      (the local spec's SDPA keeps the view, hence the whole qkv output). FP8 attention keeps q, k, v in FP8 and,
      under delayed scaling, its output in FP8 too (the output linear_proj gets is a bf16 copy it does not keep).
    - The MLP's activation is megatron-core's own, as in the local spec; MoE layers (a separate TE norm before the
      router) keep the local spec's router and expert tensors, counted in bf16 also under FP8.
    te_attention=False: megatron-kd's sink / window core attention under TE's linears (its terms are the local
    spec's, RoPE included: such models use YaRN, which TE does not fuse). selective: the core attention is
    recomputed; its checkpoint keeps q, k after RoPE and the v view (so the qkv output), linear_proj its input.
    """
    t, h, d = lay.tp, shape.hidden_size, shape.kv_channels
    ts = T // t if lay.sp else T
    nq, nkv = shape.num_attention_heads // t, shape.num_query_groups // t
    x = b if fp8 is None else fp8_element_bytes(fp8)
    norm = b * ts * h + 4 * ts * (2 if shape.normalization == "LayerNorm" else 1)
    a = {"norm1 input (residual)": norm, "qkv input (norm1 out)": x * ts * h}
    if not te_attention:
        own = sdpa_attention_activations(shape, lay, T, b, micro_batch)
        if selective:   # the core attention is recomputed, as on the local spec
            core = attention_activation_bytes(T, 1, 1, 1, sink=shape.attention_sinks, window=None)
            own = {k: v for k, v in own.items() if k not in core}
        a |= own
    elif selective:
        a["qkv output (v is a view of it)"] = b * T * (nq + 2 * nkv) * d
        a["q, k after fused RoPE"] = b * T * (nq + nkv) * d
    elif fp8_attention:
        e = fp8_element_bytes(fp8)
        a["q, k, v in FP8"] = e * T * (nq + 2 * nkv) * d
        a["attention out + softmax stats"] = (e if fp8 == "delayed" else b) * T * nq * d + 4 * T * nq
    else:
        a["q, k after fused RoPE"] = b * T * (nq + nkv) * d
        a["v (contiguous copy)"] = b * T * nkv * d
        a["attention out + softmax stats"] = b * T * nq * d + 4 * T * nq
    if fp8 == "delayed":
        a["proj input (FP8 copy)"] = x * T * nq * d
    elif selective and te_attention:
        a["proj input"] = b * T * nq * d    # the recomputed attention's output: linear_proj alone keeps it
    return a | mlp_activations(shape, lay, T, moe, norm, b=b, swiglu_fusion=swiglu_fusion, x=b if moe else x)


def routed_tokens(shape: ModelShape, lay: Layout, T: int) -> int:
    """Token copies one rank's experts process per micro-batch (balanced routing): ETP * T * topk / TP."""
    return lay.expert_tp * T * shape.moe_router_topk // lay.tp


def layer_backward_extra(shape: ModelShape, lay: Layout, T: int, moe: bool, b: int = 2) -> dict:
    """Gradients alive on top of the saved activations while one layer runs backward (bytes).

    Autograd frees each node's saved tensors as it goes, so the largest gradients (SwiGLU's, the expert
    tokens', SDPA's dq/dk/dv + fp32 dq accumulator) mostly replace activations already released; measured on
    CPU, a recomputed layer peaks within ~5% of its saved activations above the incoming gradient. We keep
    a quarter of the largest gradient set as margin.
    """
    t, h, d = lay.tp, shape.hidden_size, shape.kv_channels
    ts = T // t if lay.sp else T
    nq, nkv = shape.num_attention_heads // t, shape.num_query_groups // t
    g = 2 if shape.gated_mlp else 1
    attn = b * T * (nq + 2 * nkv) * d * 2 + 4 * T * nq * d
    mlp = 2 * b * routed_tokens(shape, lay, T) * h if moe else 2 * b * T * g * shape.ffn_hidden_size // t
    resid = 2 * b * ts * h + (b * T * h if lay.sp else 0)   # incoming + residual grads (+ SP gather)
    return {"gradients in flight (1/4 of the largest set)": max(attn, mlp) // 4, "residual-stream gradients": resid}


# ------------------------------------------------------------------------------------------------ loss

def loss_buffers(shape: ModelShape, lay: Layout, tr: Training, T: int) -> dict:
    """Loss working set on the last stage: {'fwd': bytes at the loss forward, 'held': kept into backward,
    'bwd': peak inside the loss backward, 'tail': held until the embedding backward (tied dummy grad)}."""
    t, h = lay.tp, shape.hidden_size
    vloc = padded_vocab_size(shape.vocab_size, lay.vocab_divisible_by, t) // t
    K = tr.topk
    gath = 2 * T * h if lay.sp else 0                  # the loss gathers the sequence-parallel hidden states
    targets = T * K * (8 + 4 + 1 + 8) + T * 16         # ids, log-probs, valid mask, local slot index, weights
    vh = vloc * h
    tied_tail = 2 * vh if (shape.tie_embeddings and lay.pp == 1) else 0
    if not tr.targets.distills:
        tv = T * vloc
        return dict(fwd=gath + 3 * 4 * tv, held=gath + 2 * 4 * tv, bwd=gath + 3 * 4 * tv + 6 * vh,
                    tail=tied_tail)
    online = tr.targets.teacher_each_step
    if tr.loss == "dense" or (online and tr.teacher_loss == "dense"):
        tv = T * vloc
        extra = 4 * tv if online else 0   # teacher log-probs [T, V/tp] fp32 held through the loss
        return dict(fwd=gath + targets + 3 * 4 * tv + extra, held=gath + targets + 4 * tv + extra,
                    bwd=gath + targets + 2 * 4 * tv + 2 * tv + 6 * vh + 2 * T * h + extra, tail=tied_tail)
    stats = T * (K + 4) * 4
    if tr.loss == "fused":
        # megatron_kd.loss.fused.run (its plan: loss.chunks.chunk_plan): rows follow the global vocabulary V; at tp == 1 the "scaled" path keeps
        # S rows of anchored bf16 logits (no fp32 logits; LOGITS="fp32": C rows of fp32 logits and S >= C rows
        # of bf16 dz), at tp > 1 (two-pass) C == S rows of each.
        import torch  # here, not at import: `megatron-kd plan --help` loads no torch
        from ..loss.chunks import chunk_plan  # the plan fused.run follows: one copy of the rule
        cp = chunk_plan(max(1, shape.vocab_size), h, tp=t, dtype=torch.bfloat16)
        C, S = (0, cp.super_rows) if cp.path == "anchored" else (cp.sub_rows, cp.super_rows)
        z = min(T, C) * vloc * 4
        e = min(T, S) * vloc * 2
        fp32_main = tr.grad_fp32 and tr.optimizer != "lean_adam"
        acc = 0 if tr.main_grad_fusion and fp32_main else 4 * vh  # a bf16 main_grad gets an fp32 acc added
        wcopy = 0 if tr.main_grad_fusion else 2 * vh
        held = gath + targets + stats + 2 * T * h + wcopy
        return dict(fwd=gath + targets + stats + 2 * T * h + z + e + acc + wcopy, held=held,
                    bwd=held + 2 * T * h + 2 * vh, tail=tied_tail)
    from ..loss.chunks import default_chunk_size  # the torch impls' chunk rows (lazy: no torch for --help)
    c = default_chunk_size(max(1, shape.vocab_size))
    cv = min(T, c) * vloc * 4
    if tr.loss == "chunked":
        held = gath + targets + stats
        return dict(fwd=held + 3 * cv, held=held, bwd=held + 2 * T * h + 6 * vh + 2 * cv, tail=tied_tail)
    held = gath + targets + 2 * T * h + 2 * vh        # forward_chunked: finished grads kept for backward
    return dict(fwd=gath + targets + stats + 2 * T * h + 6 * vh + 2 * cv, held=held,
                bwd=held + 2 * T * h + 2 * vh, tail=tied_tail)


def teacher_forward_peak(teacher: ModelShape, lay: Layout, tr: Training, T: int, exact_fusions: bool = False) -> float:
    """Transient bytes of a no-grad teacher forward (one layer's intermediates + the output top-K chunk).

    The largest intermediate is fc1's output; eager SwiGLU holds it beside three more tensors of half its size
    (silu, the offset linear half, their product). exact_fusions (MegatronTeacher's forward, models/fusions.py)
    makes only the product, for a dense bias-free SwiGLU MLP (models/fusions.py's mlp_fusable)."""
    t, h = lay.tp, teacher.hidden_size
    act = layer_activations(teacher, lay, T, teacher.is_moe)
    fused = exact_fusions and teacher.activation == "swiglu" and not teacher.is_moe and not teacher.add_bias_linear
    layer = max(act.values()) * (1.5 if fused else 3) + 4 * (T // t if lay.sp else T) * h
    vloc = padded_vocab_size(teacher.vocab_size, lay.vocab_divisible_by, t) // t
    if tr.teacher_loss == "dense":
        out = T * vloc * (2 + 4 + 4)                    # bf16 logits, fp32 copy, log-softmax
    else:
        c = max(16, LOGITS_PER_CHUNK // vloc)  # teacher top-K on the fly: bf16 logits of one chunk
        out = min(T, c) * vloc * 2 + 2 * T * tr.topk * 12   # results of two micro-batches (one queued behind)
    return max(layer, out) + 2 * T * h


def cache_build_peak(teacher: ModelShape, lay: Layout, tr: Training, T: int) -> dict:
    """Bytes per GPU of a cache build (kd.build_cache, `megatron-kd cache build`): the teacher's bf16 weights on
    its TP shard (unpipelined) and one micro-batch's no-grad forward with the top-K of teacher_forward_peak."""
    lay = replace(lay, pp=1, cp=1)
    weights = 2 * param_counts(teacher, lay, 0).total
    forward = teacher_forward_peak(teacher, lay, replace(tr, teacher_loss="topk"), T, exact_fusions=True)
    return {"weights": weights, "forward": forward, "total": weights + forward}


# ------------------------------------------------------------------------------------------------ the plan

def plan_stage(shape: ModelShape, lay: Layout, tr: Training, stage: int) -> Plan:
    lay.check(shape)
    tr.check()
    pc = param_counts(shape, lay, stage)
    T = tokens_per_rank(tr, lay)
    p = Plan(shape, lay, tr, stage, params_local=pc.total, tokens_local=T)
    osh = _OptimizerSharding.of(lay, tr)
    static = _add_static(p, pc, osh)
    acts, working = _add_activations(p, pc)
    lb, teach, online_targets = _add_loss_and_teacher(p)
    wgrad, emb_grad, opt = _add_transients(p, pc, osh, working)
    p.phases = {
        "teacher forward": static + teach if tr.targets.teacher_each_step else 0.0,
        "forward end (loss)": static + acts + lb["fwd"] + online_targets,
        "backward": static + acts + lb["held"] + online_targets + max(lb["bwd"] - lb["held"],
                                                                       lb["tail"] + working + wgrad),
        "backward end": static + lb["tail"] + emb_grad,
        "optimizer step": static + opt,
    }
    p.phases = {k: v for k, v in p.phases.items() if v > 0}
    return p


@dataclass(frozen=True)
class _OptimizerSharding:
    """How the optimizer holds its state: lean_adam, the fp32 main_grad, and the dense / expert shard counts of the
    distributed optimizer (1: not sharded)."""
    lean: bool
    grad_fp32: bool
    dsh: int
    esh: int

    @staticmethod
    def of(lay: Layout, tr: Training) -> "_OptimizerSharding":
        lean = tr.optimizer == "lean_adam"
        sharded = tr.distributed_optimizer and not lean
        return _OptimizerSharding(lean, tr.grad_fp32 and not lean, lay.dense_shard if sharded else 1,
                                  lay.expert_dp if sharded else 1)


def _add(p: Plan, group: str, name: str, b, note: str = "") -> None:
    p.items.append(Item(group, name, float(b), note))


def _add_static(p: Plan, pc, osh: _OptimizerSharding) -> float:
    """Weights, grads, optimizer state, teacher weights and the cache reader; returns their sum."""
    tr, T, last = p.training, p.tokens_local, p.stage == p.layout.pp - 1
    _add(p, "static", "weights", 2 * pc.total, f"bf16, {pc.total / 1e9:.3f} B params on this rank")
    _add(p, "static", "grads", (4 if osh.grad_fp32 else 2) * pc.total,
         "DDP main_grad buffer, " + ("fp32" if osh.grad_fp32 else "bf16"))
    if osh.lean:
        _add(p, "static", "optimizer", (2 + sum(tr.moment_bytes)) * pc.total,
             "lean_adam: int16 master remainder + m, v ({} + {} B), not sharded".format(*tr.moment_bytes))
    else:
        _add(p, "static", "optimizer", 12 * pc.dense / osh.dsh + 12 * pc.expert / osh.esh,
             f"fp32 main params + Adam m, v; dense / {osh.dsh}" + (f", experts / {osh.esh}" if pc.expert else ""))
    if tr.quant != "none" or tr.fp8:
        lins = [x for i in range(p.stage * pc.layers, (p.stage + 1) * pc.layers)
                for x in _linears(p.shape, p.layout, p.shape.is_moe and i % p.shape.moe_layer_freq == 0)]
    if tr.quant != "none":
        _add(p, "static", "quantizer state", quantizer_bytes(tr.quant, lins),
             f"ModelOpt {tr.quant}: amax / AWQ scales of {len(lins)} linear layers (fp32)")
    if tr.fp8:
        # TE quantizes each weight once per step into a workspace cached on its module (megatron-core passes
        # is_first_microbatch): the row-wise copy for the forward GEMM and the column-wise (transposed) one for the
        # input gradient's GEMM, both kept from one step to the next.
        n = sum(i * o * c for i, o, c in lins)
        _add(p, "static", "FP8 weight copies", 2 * fp8_element_bytes(tr.fp8, weight=True) * n,
             f"TE {tr.fp8}: row-wise + transposed FP8 of {n / 1e9:.3f} B linear weights (embedding, output layer "
             "and router stay bf16)")
    if tr.targets.teacher_each_step:
        tpc = param_counts(tr.teacher, p.layout, p.stage)
        _add(p, "static", "teacher weights", 2 * tpc.total, f"bf16 {tr.teacher.name}, no grads")
    if tr.targets.reads_cache and last:
        _add(p, "static", "cache reader", tr.cache_buffers * T * tr.topk * 12,
             f"{tr.cache_buffers} x top-{tr.topk} batches (int64 ids + fp32 log-probs)")
    return p.group_bytes("static")


def _linears(shape: ModelShape, lay: Layout, moe: bool) -> list:
    """(in, out, count) of one layer's linear layers on one rank: the ones ModelOpt quantizes, and Transformer
    Engine's linears in its spec (those FP8 runs in)."""
    t, h, kv = lay.tp, shape.hidden_size, shape.kv_channels
    g = 2 if shape.gated_mlp else 1
    out = [(h, (shape.num_attention_heads + 2 * shape.num_query_groups) * kv // t, 1),
           (shape.num_attention_heads * kv // t, h, 1)]
    if moe:
        f, n = shape.moe_ffn_hidden_size // lay.expert_tp, shape.num_moe_experts // lay.ep
        out += [(h, g * f, n), (f, h, n)]
        if shape.moe_shared_expert_intermediate_size:
            f = shape.moe_shared_expert_intermediate_size // t
            out += [(h, g * f, 1), (f, h, 1)]
    else:
        out += [(h, g * shape.ffn_hidden_size // t, 1), (shape.ffn_hidden_size // t, h, 1)]
    return out


def quantizer_bytes(fmt: str, linears) -> int:
    """fp32 buffers of ModelOpt's quantizers over `linears` ((in, out, count) each): what quant_formats/ says
    format `fmt` keeps per linear layer (amax, AWQ scales)."""
    floats = quant_formats.get(fmt).buffer_floats
    return sum(4 * floats(i, o) * n for i, o, n in linears)


def _stage_layers(p: Plan, pc) -> tuple[list, list]:
    """Per layer of this stage: the activations saved for backward, and backward's extra working memory."""
    shape, lay, tr, T = p.shape, p.layout, p.training, p.tokens_local
    per_layer, extra = [], []
    for i in range(p.stage * pc.layers, (p.stage + 1) * pc.layers):
        moe = shape.is_moe and i % shape.moe_layer_freq == 0
        if tr.spec == "te":
            a = te_layer_activations(shape, lay, T, moe, micro_batch=tr.micro_batch, swiglu_fusion=tr.swiglu_fusion,
                                     fp8=tr.fp8, fp8_attention=tr.fp8_attention,
                                     te_attention=tr.te_attention,
                                     selective=tr.recompute == "selective")
        else:
            a = layer_activations(shape, lay, T, moe, micro_batch=tr.micro_batch, swiglu_fusion=tr.swiglu_fusion,
                                  fused_norm=tr.fused_norm)
        if tr.recompute == "selective" and tr.spec != "te":
            core = attention_activation_bytes(T, 1, 1, 1, sink=shape.attention_sinks, window=None)
            a = {k: v for k, v in a.items() if k not in core}  # the core attention is recomputed
        per_layer.append(sum(a.values()))
        extra.append(sum(layer_backward_extra(shape, lay, T, moe).values()))
    return per_layer, extra


def _add_activations(p: Plan, pc) -> tuple[float, float]:
    """What the in-flight microbatches keep for backward; returns (their bytes, backward's working set)."""
    shape, lay, tr, T = p.shape, p.layout, p.training, p.tokens_local
    first, last = p.stage == 0, p.stage == lay.pp - 1
    inflight = min(lay.pp - p.stage, tr.num_microbatches)
    ts = T // lay.tp if lay.sp else T
    per_layer, extra = _stage_layers(p, pc)
    ckpt = 2 * ts * shape.hidden_size
    if tr.recompute == "full":
        n_rc = pc.layers if tr.recompute_layers is None else min(pc.layers, tr.recompute_layers)
        kept = n_rc * ckpt + sum(per_layer[n_rc:])
        _add(p, "activations", "layer checkpoints", inflight * n_rc * ckpt,
             f"{inflight} x {n_rc} layers x [T/sp, H] bf16")
        if n_rc < pc.layers:
            _add(p, "activations", "unrecomputed layers", inflight * sum(per_layer[n_rc:]),
                 f"{inflight} x {pc.layers - n_rc} layers' saved tensors ({tr.layers_name})")
        working = max(per_layer) + max(extra) if n_rc else max(extra)
        if 0 < n_rc < pc.layers:
            # Backward reaches the recomputed (first) layers after the unrecomputed ones, whose saved tensors
            # (this micro-batch's) are freed by then: the recompute working set never meets them. Before that,
            # the unrecomputed layers need only their gradients.
            working = max(max(extra), working - sum(per_layer[n_rc:]))
    else:
        kept = sum(per_layer)
        _add(p, "activations", "saved activations", inflight * kept,
             f"{inflight} x {pc.layers} layers ({tr.recompute} recompute, {tr.layers_name})")
        working = max(extra)
    if first:
        _add(p, "activations", "embedding output", 0, "counted as layer 0's input")
    fin = 2 * ts * shape.hidden_size + 4 * ts if last else 0
    if last:
        _add(p, "activations", "final norm", inflight * fin, "input + rstd")
    return inflight * (kept + fin), working


def _add_loss_and_teacher(p: Plan) -> tuple[dict, float, int]:
    """The loss's buffers (last stage) and the online teacher's forward; returns (loss buffers, teacher forward
    peak, the online top-K targets' bytes)."""
    shape, lay, tr, T, last = p.shape, p.layout, p.training, p.tokens_local, p.stage == p.layout.pp - 1
    lb = loss_buffers(shape, lay, tr, T) if last else dict(fwd=0, held=0, bwd=0, tail=0)
    online = tr.targets.teacher_each_step
    teach = teacher_forward_peak(tr.teacher, lay, tr, T) if online else 0.0
    online_targets = T * tr.topk * 12 if (online and tr.teacher_loss == "topk") else 0
    if last:
        _add(p, "loss", "loss (forward)", lb["fwd"], f"{tr.loss if tr.targets.distills else 'ce'} impl, {T} tokens")
        _add(p, "loss", "loss (held for backward)", lb["held"], "")
        _add(p, "loss", "loss (backward)", lb["bwd"], "")
    if online:
        _add(p, "transient", "teacher forward", teach, f"{tr.teacher.name}, no grad, {tr.teacher_loss} targets")
    return lb, teach, online_targets


def _add_transients(p: Plan, pc, osh: _OptimizerSharding, working: float) -> tuple[float, float, float]:
    """Backward's working set, the bf16 weight and embedding grads, the optimizer step; returns (weight grad,
    embedding grad, optimizer step) bytes."""
    tr, first = p.training, p.stage == 0
    wgrad = 2 * pc.largest_layer_tensor
    emb_grad = 2 * (pc.embedding if first else 0)
    _add(p, "transient", "recompute working set" if tr.recompute == "full" else "backward gradients", working,
         "one recomputed layer's activations + gradients (the unrecomputed layers' freed by then)"
         if tr.recompute == "full" else "gradients in flight")
    _add(p, "transient", "bf16 weight grad", wgrad, "largest layer weight's grad before it joins main_grad")
    if first:
        _add(p, "transient", "embedding grad", emb_grad, "bf16 [V/tp, H] at the end of backward")
    opt = 0.0
    if tr.adam_impl == "foreach" and not osh.lean:
        opt += 4 * max(pc.dense / osh.dsh, pc.expert / osh.esh)
    if not osh.grad_fp32 and not osh.lean:
        opt += 4 * (pc.dense / osh.dsh + pc.expert / osh.esh)
    _add(p, "transient", "optimizer step", opt, "lean_adam (in place)" if osh.lean else
         f"{tr.adam_impl} AdamW" + ("" if osh.grad_fp32 else " + fp32 grad copy"))
    return wgrad, emb_grad, opt


def plan_memory(shape: ModelShape, layout: Layout = Layout(), training: Training = Training(),
                stage: int | None = None) -> Plan:
    """The plan of the worst pipeline stage (or of `stage`)."""
    if stage is not None:
        return plan_stage(shape, layout, training, stage)
    stages = sorted({0, layout.pp - 1} | ({1} if layout.pp > 2 else set()))
    return max((plan_stage(shape, layout, training, s) for s in stages), key=lambda p: p.peak_bytes)

