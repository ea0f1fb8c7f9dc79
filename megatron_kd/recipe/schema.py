"""The recipe schema: what a recipe (megatron_kd/recipes/, or one of a user's) may contain.

A recipe is composed by Hydra from the groups model, teacher, parallel, data, kd, train (recipes/README.md) over
these dataclasses, registered in Hydra's ConfigStore by recipe/compose.py.
`to_recipe` merges it into the dataclasses below, so a misspelt or unknown key fails at once with its full
name; recipe/checks.py then checks what depends on several sections (TP dividing heads, batch sizes, modes).
"""
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from ..errors import RecipeError, RunError  # noqa: F401  (users import them from here too)
from ..field_policy import architecture, data, free, schedule, targets, updates, weights
from ..loss.options import KDLoss
ATTENTION_BACKENDS = ("auto", "te", "sdpa", "local")
FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
PRECISIONS = ("fp32", "bf16", "fp16")
GATED_ACTIVATIONS = ("swiglu", "quick_geglu")     # gated MLPs (fc1 is 2 x ffn wide); quick_geglu: GPT-OSS
# A key each recipe states, null included: a composed recipe that leaves it out shows `???`. Hydra merges a recipe
# onto the schema's defaults, and a merge keeps a default over `???`; so a recipe's own `???` (a value the user
# must give) survives composition only where the schema node holds `???` too (recipe/compose.py).
RECIPE_SETS = {"recipe_sets": True}


@dataclass
class ModelConfig:
    """One GPT architecture (student in `model`, teacher in `teacher`). Megatron TransformerConfig names."""
    name: str = free("gpt")
    num_layers: int = architecture(2)
    hidden_size: int = architecture(64)
    ffn_hidden_size: Optional[int] = architecture(None)  # None: 4 x hidden_size
    num_attention_heads: int = architecture(4)
    num_query_groups: Optional[int] = architecture(None)  # GQA groups; None: one per head
    kv_channels: Optional[int] = architecture(None)  # head dim; None: hidden_size / heads
    normalization: str = architecture("RMSNorm")  # RMSNorm | LayerNorm
    layernorm_epsilon: float = architecture(1e-5)
    activation: str = architecture("swiglu")     # swiglu | gelu | squared_relu
    add_bias_linear: bool = architecture(False)
    add_qkv_bias: bool = architecture(False)
    qk_layernorm: bool = architecture(False)
    position_embedding_type: str = architecture("rope")  # rope | learned_absolute | none
    rotary_base: int = architecture(10000)
    rotary_percent: float = architecture(1.0)
    # Llama 3.x RoPE frequency scaling: Hugging Face's rope_type "llama3", megatron-core's RotaryEmbedding
    # rope_scaling (models/builder.py). Wavelengths longer than original / low_freq_factor are stretched by
    # factor, those shorter than original / high_freq_factor are kept, the ones between are interpolated.
    # Llama-3.1: factor 8, Llama-3.2: factor 32; both low 1, high 4, original 8192 (recipes/model/llama3*.yaml).
    # rope_scaling: true = Llama 3 scaling with the four keys below (needs rope); they are config.json's
    # rope_scaling.factor (>= 1), .low_freq_factor (> 0), .high_freq_factor (> low_freq_factor) and
    # .original_max_position_embeddings. Newer than some checkpoints, which were made with plain RoPE.
    rope_scaling: bool = architecture(False, absent_is_default=True)
    rope_scaling_factor: float = architecture(8.0, absent_is_default=True)
    rope_low_freq_factor: float = architecture(1.0, absent_is_default=True)
    rope_high_freq_factor: float = architecture(4.0, absent_is_default=True)
    rope_original_max_position_embeddings: int = architecture(8192, absent_is_default=True)
    tie_embeddings: bool = architecture(True)    # share the input embedding and output layer weights
    init_method_std: float = free(0.02)
    make_vocab_size_divisible_by: int = architecture(128)  # Megatron pads the vocabulary to a multiple of this x TP
    num_moe_experts: Optional[int] = architecture(None)
    moe_router_topk: int = architecture(2)
    moe_ffn_hidden_size: Optional[int] = architecture(None)
    moe_grouped_gemm: bool = free(False)
    attention_backend: str = free("auto")        # auto (TE if importable, else sdpa) | te | sdpa | local
    # FP8 of Transformer Engine's layers (needs the TE backend): null (off) | hybrid (e4m3 forward, e5m2 gradients)
    # | e4m3. The embedding, the output layer and the fused KD loss stay in bf16.
    fp8: Optional[str] = free(None)
    fp8_recipe: str = free("tensorwise")         # Hopper: tensorwise (current scaling) | delayed | blockwise
    # Transformer Engine's FP8 attention (cuDNN) as well; with fp8_recipe=delayed (TE has no FP8 attention for
    # current scaling on Hopper). Not for models with attention sinks / sliding windows.
    fp8_attention: bool = free(False)
    recompute_granularity: Optional[str] = free(None)  # null | full | selective
    recompute_method: Optional[str] = free(None)  # uniform | block (with full)
    recompute_num_layers: Optional[int] = free(None)
    # gpt-oss (models/gpt_oss.py maps these onto TransformerConfig): GPT-OSS's attention sinks,
    # sliding window, clamped GLU and YaRN (recipes/model/gpt_oss_20b.yaml); the defaults turn them off
    softmax_type: str = architecture("vanilla")  # vanilla | learnable (per-head sinks) | off-by-one
    window_size: Optional[list] = architecture(None)  # [left, 0]: keys i - left .. i (HF sliding_window W: [W - 1, 0])
    # every Nth layer full attention (GPT-OSS: 2); null: all windowed
    window_attn_skip_freq: Optional[int] = architecture(None)
    activation_func_clamp_value: Optional[float] = architecture(None)  # clamped GLU (GPT-OSS: 7.0)
    glu_linear_offset: float = architecture(0.0)  # + this on the GLU's linear half (GPT-OSS: 1.0)
    yarn: dict = architecture(factory=dict)      # position_embedding_type=yarn: megatron's yarn_* without the prefix
    megatron: dict = free(factory=dict)          # any other TransformerConfig field, passed through as is
    # a local Hugging Face checkpoint: architecture (config.json, overriding the keys above)
    # and weights through Megatron-Bridge's AutoBridge (megatron_kd/hf); null = the keys above, random init
    hf_path: Optional[str] = weights(None)


@dataclass
class TeacherConfig(ModelConfig):
    """The teacher's architecture plus where its weights come from (online mode and cache building)."""
    load: Optional[str] = weights(None)          # dist_checkpointing dir (a `megatron-kd train` save dir)


@dataclass
class ParallelConfig:
    tp: int = free(1)                            # tensor parallel
    pp: int = free(1)                            # pipeline parallel (GPU only: Megatron's schedules)
    vpp: Optional[int] = free(None)              # virtual pipeline stages per rank
    cp: int = free(1)                            # context parallel (needs TE attention)
    ep: int = free(1)                            # expert parallel (MoE)
    etp: Optional[int] = free(None)              # expert tensor parallel
    sequence_parallel: bool = free(False)
    use_distributed_optimizer: bool = free(True)  # Megatron's DistributedOptimizer (GPU)
    overlap_grad_reduce: bool = free(False)
    overlap_param_gather: bool = free(False)


@dataclass
class DataConfig:
    kind: str = data("mock")                     # mock | indexed
    path: Any = data(None, **RECIPE_SETS)        # indexed: prefix (or list: weight, prefix, ...) of
                                                 # .bin/.idx; null: none (mock data)
    tokenizer: Optional[str] = data(None)        # a tokenizers JSON file (`megatron-kd data prepare` writes one)
    vocab_size: Optional[int] = data(None)       # unpadded vocabulary; None: from the tokenizer
    seq_length: int = data(128)
    split: str = data("969,30,1")
    seed: int = data(1234)
    eod_id: Optional[int] = data(None)           # None: the tokenizer's <|endoftext|> (mock: vocab_size - 1)
    eod_mask_loss: bool = data(False)
    index_cache: Optional[str] = free(None)      # where GPTDataset writes its index .npy files
    num_workers: int = free(0)                   # DataLoader worker processes per rank
    eval_samples: Optional[int] = free(None)     # None: train.eval_iters x global_batch_size


@dataclass
class OfflineKD(KDLoss):
    """The keys of offline KD that a recipe's `kd` section and a Bridge YAML's `kd` section share: the loss keys
    (loss.KDLoss) plus the cache and how it is read. One name and one default each, in both dialects."""
    cache: Optional[str] = free(None, **RECIPE_SETS)  # offline: the teacher top-K cache
                                                 # directory; null: none (online and ce modes)
    top_k: Optional[int] = targets(None)         # K to train with; null: the cache's K (online and building a
                                                 # cache need a number)
    check_tokens: bool = free(True)              # compare each sample's token hash with the cache's
    log_ce: bool = free(False)                   # also report the student's CE in KD modes (one forward-only
                                                 # output-layer pass per micro-batch; not free at 32K x 128K)


@dataclass
class KDConfig(OfflineKD):
    """The recipe's `kd` section: OfflineKD's keys plus the mode and where the teacher's targets come from."""
    mode: str = targets("offline")               # offline (top-K cache) | online (teacher beside) | ce (labels only)
    build_cache: bool = free(False)              # offline: build the cache from `teacher` first when it is missing
    cache_encoding: str = free("fp16")           # when building: fp16 | fp32 | compact | topp | sampled
    cache_top_p: Optional[float] = free(None)    # topp: per position the fewest ids (<= top_k) holding this mass
    cache_min_k: Optional[int] = free(None)      # topp: keep at least this many ids (null: 1)
    cache_samples: Optional[int] = free(None)    # sampled: N draws per position from the whole distribution
    cache_sample_seed: Optional[int] = free(None)  # sampled: the draws' seed (null: 0)
    teacher_id: Optional[str] = targets(None)    # offline: the cache's teacher ("name" or "name@weights_hash");
                                                 # a cache from another teacher is refused


@dataclass
class TrainConfig:
    iters: int = free(100)
    micro_batch_size: int = free(4)
    global_batch_size: int = updates(8)
    lr: float = schedule(1e-3)
    min_lr: float = schedule(1e-4)
    lr_warmup_iters: int = schedule(0)
    lr_decay_style: str = schedule("cosine")     # constant | linear | cosine | inverse-square-root | WSD
    lr_decay_iters: Optional[int] = schedule(None)  # None: iters
    weight_decay: float = updates(0.1)
    adam_beta1: float = updates(0.9)
    adam_beta2: float = updates(0.95)
    adam_eps: float = updates(1e-8)
    clip_grad: float = updates(1.0)
    precision: str = updates("fp32")             # fp32 | bf16 | fp16
    optimizer: str = updates("adam")             # adam (Megatron's) | lean_adam (bf16: 12 B/param, lean_adam.py)
    exp_avg_dtype: str = free("bf16")            # lean_adam moments: fp32 | bf16
    exp_avg_sq_dtype: str = free("fp32")
    seed: int = free(1234)
    save: Optional[str] = free(None)             # checkpoint dir; None: <hydra run dir>/checkpoints
    load: Optional[str] = free(None)             # resume from the latest checkpoint here if any; None: save
    pretrained: Optional[str] = free(None)       # initialize the student's weights (not the optimizer) from here
    save_interval: Optional[int] = free(None)    # None: only at the end
    save_at_end: bool = free(True)               # false: no final checkpoint (a speed / memory measurement only)
    export_hf: Optional[str] = free(None)        # at the end, the student as an HF checkpoint here (model.hf_path runs)
    stop_at: Optional[int] = free(None)          # stop (with a checkpoint) after this iteration, keep the schedule
    log_interval: int = free(10)
    eval_interval: Optional[int] = free(None)    # None: only at the end
    eval_iters: int = free(2)
    progress: bool = free(True)                  # console progress bar (rank 0)
    tensorboard: bool = free(True)               # <save>/tensorboard when tensorboard is installed
    device: str = free("auto")                   # auto | cuda | cpu
    nonfinite: str = free("stop")                # NaN/inf loss or gradients: stop | skip (the update, said)
    resume_changes: list = free(factory=list)    # keys a resume may change on purpose (training/resume.py)


@dataclass
class QuantConfig:
    """The student quantized with NVIDIA ModelOpt (fake quantization: the weights stay in train.precision, each
    linear layer's weights and inputs pass through quantizers) and then trained: QAT in kd=ce, QAD otherwise."""
    # a format registered in megatron_kd/quant_formats/ (none: unquantized; a wrong name is refused listing them).
    # Free on resume: a student restored quantized keeps its quantizers, and the trainer refuses another format
    format: str = free("none")
    calib_samples: int = free(64)                # training samples the quantizers are calibrated on (amax, AWQ)


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    kd: KDConfig = field(default_factory=KDConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)


def _schema_error(e) -> RecipeError:
    key = getattr(e, "full_key", None) or ""
    msg = (getattr(e, "msg", None) or str(e)).splitlines()[0]  # OmegaConf appends its internals
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        section = key.rsplit(".", 1)[0] if "." in key else ""
        known = _known_keys(section)
        return RecipeError(f"unknown recipe key {key!r}" + (f"; {section} takes: {', '.join(known)}" if known else ""))
    return RecipeError(f"recipe key {key!r}: {msg}" if key else f"recipe: {msg}")


def _known_keys(section: str) -> list:
    cls = {f.name: f.default_factory for f in fields(Recipe)}.get(section)
    return [f.name for f in fields(cls())] if cls else []


def to_recipe(cfg) -> Recipe:
    """An OmegaConf/dict recipe -> Recipe dataclasses; unknown keys and wrong types raise RecipeError."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    # as plain containers: a key added to a composed recipe's typed node (Hydra's `+kd.topk=3`) is then refused too
    cfg = OmegaConf.create(OmegaConf.to_container(cfg) if OmegaConf.is_config(cfg) else cfg)
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    schema = OmegaConf.structured(Recipe)
    try:
        merged = OmegaConf.merge(schema, cfg)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _schema_error(e) from None
