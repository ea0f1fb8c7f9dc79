"""Model shapes and exact per-rank parameter counts of Megatron-Core GPT models (local or TE spec).

A ModelShape (field names: Megatron TransformerConfig's, as in megatron_kd.recipe.schema.ModelConfig) names
everything that decides the parameter count of a `megatron.core.models.gpt.GPTModel`:
dense or MoE, GQA, SwiGLU, RMSNorm/LayerNorm, biases, tied embeddings. `param_counts(shape, layout)`
returns what one rank of a (TP, PP, EP, ETP) layout holds, split into the groups Megatron's optimizer
shards differently (dense parameters over DP x CP, expert parameters over the expert-data-parallel group).
tests/plan/test_plan.py checks these counts against real GPTModels built on CPU.
"""
from dataclasses import asdict, dataclass, field, replace

from ..rules import padded_vocab_size


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int        # GQA groups (kv heads)
    kv_channels: int             # head dim
    ffn_hidden_size: int         # dense MLP width (per gate: SwiGLU's fc1 is [2 * ffn_hidden_size, hidden_size])
    vocab_size: int              # tokenizer vocabulary (Megatron pads it: rules.padded_vocab_size)
    tie_embeddings: bool = False
    activation: str = "swiglu"   # swiglu (gated) | gelu | squared_relu
    normalization: str = "RMSNorm"  # RMSNorm (weight) or LayerNorm (weight + bias)
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    num_moe_experts: int = 0     # 0: dense
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0  # per expert
    moe_shared_expert_intermediate_size: int = 0  # shared expert width (0: none)
    moe_layer_freq: int = 1      # every k-th layer is MoE (1: all), like Megatron's moe_layer_freq=int
    learned_pos_emb: int = 0     # max positions of learned absolute position embeddings (0: RoPE)
    attention_sinks: bool = False  # GPT-OSS's learned per-head sinks: its attention keeps more for backward

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts > 0

    @property
    def gated_mlp(self) -> bool:
        from ..recipe.schema import GATED_ACTIVATIONS  # swiglu, quick_geglu (GPT-OSS): the one copy of the rule
        return self.activation in GATED_ACTIVATIONS

    def moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        return sum(1 for i in range(self.num_layers) if i % self.moe_layer_freq == 0)

    def with_(self, **kw) -> "ModelShape":
        return replace(self, **kw)

    def as_dict(self) -> dict:
        return asdict(self)


def _presets() -> dict:
    """The registered families' public architectures (shapes only: the benchmarks use random weights)."""
    from .. import families
    return {name: ModelShape(name, **kw) for f in families.all_families() for name, kw in f.shapes.items()}


PRESETS = _presets()
ALIASES = {k.replace("-", "").replace(".", ""): k for k in PRESETS}
ALIASES.update({k.replace("-", "_").replace(".", ""): k for k in PRESETS})


def _family_aliases() -> dict:
    from .. import families
    return {a: k for f in families.all_families() for a, k in f.aliases.items()}


ALIASES.update(_family_aliases())


def preset(name: str) -> ModelShape:
    key = name.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    key = ALIASES.get(key) or ALIASES.get(key.replace("-", "").replace(".", "").replace("_", ""))
    if key is None:
        raise KeyError(f"unknown model shape {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[key]


@dataclass(frozen=True)
class Layout:
    """One rank's view of the parallel layout. etp (expert TP) defaults to tp, as in Megatron."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    dp: int = 1
    etp: int | None = None
    sequence_parallel: bool | None = None   # default: on when tp > 1
    vocab_divisible_by: int = 128           # Megatron-LM's --make-vocab-size-divisible-by

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else bool(self.sequence_parallel) and self.tp > 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def dense_shard(self) -> int:
        """Ranks the distributed optimizer shards dense parameters over (Megatron's intra DP x CP group)."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size: world / (ETP x EP x PP)."""
        denom = self.expert_tp * self.ep * self.pp
        if self.world % denom:
            raise ValueError(f"world size {self.world} (tp*pp*cp*dp) is not divisible by etp*ep*pp = {denom}")
        return self.world // denom

    def check(self, shape: ModelShape | None = None) -> None:
        for k in ("tp", "pp", "ep", "cp", "dp"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1")
        self.expert_dp  # noqa: B018  (raises on an impossible expert layout)
        if shape is None:
            return
        if shape.num_attention_heads % self.tp or shape.num_query_groups % self.tp:
            raise ValueError(f"tp={self.tp} must divide the heads ({shape.num_attention_heads}) and kv heads "
                             f"({shape.num_query_groups}) of {shape.name}")
        if shape.num_layers % self.pp:
            raise ValueError(f"pp={self.pp} must divide the {shape.num_layers} layers of {shape.name}")
        if shape.is_moe:
            if shape.num_moe_experts % self.ep:
                raise ValueError(f"ep={self.ep} must divide the {shape.num_moe_experts} experts of {shape.name}")
            if self.tp > 1 and not self.sp:
                raise ValueError("Megatron requires sequence parallelism for MoE with tp > 1")
            if shape.add_bias_linear and self.expert_tp > 1:
                raise ValueError("Megatron supports MoE biases only with expert TP (etp) = 1")
        elif self.ep > 1:
            raise ValueError(f"ep={self.ep} needs an MoE model; {shape.name} is dense")


@dataclass
class ParamCounts:
    """Parameters held by one rank (elements), by how the optimizer shards them."""
    dense: int = 0            # non-expert, sharded over DP x CP by the distributed optimizer
    expert: int = 0           # expert weights, sharded over expert-DP
    embedding: int = 0        # of dense: word (+ position) embeddings on the first stage
    output: int = 0           # of dense: untied output layer (or the tied copy on the last stage, pp > 1)
    largest_tensor: int = 0   # elements of the largest single parameter (bf16 grad transient)
    largest_layer_tensor: int = 0  # of the transformer layers only
    per_layer_dense: int = 0  # of dense: one transformer layer (attention, norms, router, dense/shared MLP)
    per_layer_expert: int = 0
    layers: int = 0
    vocab_local: int = 0      # padded vocab / tp
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.dense + self.expert


def _norm(shape: ModelShape, width: int) -> int:
    return width * (2 if shape.normalization == "LayerNorm" else 1)


def layer_params(shape: ModelShape, layout: Layout, moe: bool) -> dict:
    """Elements of one transformer layer on one rank: {name: count}; keys ending in '@expert' are expert params."""
    t, h, d = layout.tp, shape.hidden_size, shape.kv_channels
    qkv_out = (shape.num_attention_heads + 2 * shape.num_query_groups) * d
    g = 2 if shape.gated_mlp else 1
    out = {
        "input_layernorm": _norm(shape, h),
        "linear_qkv": h * qkv_out // t + (qkv_out // t if shape.add_qkv_bias else 0),
        "linear_proj": shape.num_attention_heads * d * h // t + (h if shape.add_bias_linear else 0),
        "pre_mlp_layernorm": _norm(shape, h),
    }
    if shape.qk_layernorm:
        out["qk_layernorm"] = 2 * _norm(shape, d)
    if not moe:
        f = shape.ffn_hidden_size
        out["mlp.linear_fc1"] = h * g * f // t + (g * f // t if shape.add_bias_linear else 0)
        out["mlp.linear_fc2"] = f * h // t + (h if shape.add_bias_linear else 0)
        return out
    e = shape.num_moe_experts
    out["router"] = e * h + (e if shape.add_bias_linear else 0)
    if shape.moe_shared_expert_intermediate_size:
        fs = shape.moe_shared_expert_intermediate_size
        out["shared_expert"] = h * g * fs // t + fs * h // t + ((g * fs // t + h) if shape.add_bias_linear else 0)
    et, fe = layout.expert_tp, shape.moe_ffn_hidden_size
    one = h * g * fe // et + fe * h // et + ((g * fe // et + h) if shape.add_bias_linear else 0)
    out["experts@expert"] = (e // layout.ep) * one
    out["_one_expert_fc1"] = h * g * fe // et  # largest expert tensor (not a parameter group)
    return out


def param_counts(shape: ModelShape, layout: Layout = Layout(), stage: int = 0) -> ParamCounts:
    """Exact parameter elements on one rank of pipeline stage `stage` (Megatron GPTModel, local/TE spec)."""
    layout.check(shape)
    t, h = layout.tp, shape.hidden_size
    vloc = padded_vocab_size(shape.vocab_size, layout.vocab_divisible_by, t) // t
    per = shape.num_layers // layout.pp
    first, last = stage == 0, stage == layout.pp - 1
    pc = ParamCounts(layers=per, vocab_local=vloc)
    largest = 0
    for i in range(stage * per, (stage + 1) * per):
        moe = shape.is_moe and i % shape.moe_layer_freq == 0
        lp = layer_params(shape, layout, moe)
        one_fc1 = lp.pop("_one_expert_fc1", 0)
        dense = sum(v for k, v in lp.items() if not k.endswith("@expert"))
        expert = sum(v for k, v in lp.items() if k.endswith("@expert"))
        pc.dense += dense
        pc.expert += expert
        pc.per_layer_dense = max(pc.per_layer_dense, dense)
        pc.per_layer_expert = max(pc.per_layer_expert, expert)
        g = 2 if shape.gated_mlp else 1
        largest = max(largest, h * (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.kv_channels // t,
                      one_fc1, 0 if moe else h * g * shape.ffn_hidden_size // t)
        for k, v in lp.items():
            pc.detail[k] = pc.detail.get(k, 0) + v
    pc.largest_layer_tensor = largest
    if first:
        pc.embedding = vloc * h + shape.learned_pos_emb * h
        pc.detail["embedding"] = pc.embedding
        largest = max(largest, vloc * h)
    if last:
        fin = _norm(shape, h)
        pc.detail["final_layernorm"] = fin
        pc.dense += fin
        if not shape.tie_embeddings or layout.pp > 1:
            pc.output = vloc * h
            pc.detail["output_layer"] = pc.output
            largest = max(largest, vloc * h)
    pc.dense += pc.embedding + pc.output
    pc.largest_tensor = largest
    return pc


def total_params(shape: ModelShape, padded: bool = False) -> int:
    """Parameters of the whole model (unsharded); the tokenizer vocabulary unless padded=True."""
    lay = Layout(vocab_divisible_by=128 if padded else 1)
    return param_counts(shape, lay).total


def active_params(shape: ModelShape) -> int:
    """Parameters touched per token (MoE: top-k of the experts), tokenizer vocabulary, for FLOP counts."""
    if not shape.is_moe:
        return total_params(shape)
    lay = Layout(vocab_divisible_by=1)
    full = param_counts(shape, lay)
    per_expert = full.per_layer_expert // shape.num_moe_experts
    return full.total - shape.moe_layers() * per_expert * (shape.num_moe_experts - shape.moe_router_topk)
