"""The recipe schema: what a recipe (megatron_kd/recipes/, or one of a user's) may contain.

A recipe is composed by Hydra from the groups model, teacher, parallel, data, kd, train (recipes/README.md) over
these dataclasses, registered in Hydra's ConfigStore by recipe/compose.py.
`to_recipe` merges it into the dataclasses below, so a misspelt or unknown key fails at once with its full
name; recipe/checks.py then checks what depends on several sections (TP dividing heads, batch sizes, modes).
"""
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from ..errors import RecipeError, RunError  # noqa: F401  (users import them from here too)
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
# quant.format: ModelOpt's fake-quantized formats (models/quant.py maps each to its config); w4a16_awq is int4_awq's
# other name (4-bit weights, 16-bit activations)
QUANT_FORMATS = ("none", "fp8", "int8", "int4_awq", "w4a16_awq", "w4a8_awq", "nvfp4")
QUANT_CUDA_ONLY = ("nvfp4",)                      # ModelOpt fake-quantizes these on CUDA tensors only


@dataclass
class ModelConfig:
    """One GPT architecture (student in `model`, teacher in `teacher`). Megatron TransformerConfig names."""
    name: str = "gpt"
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: Optional[int] = None        # None: 4 x hidden_size
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None       # GQA groups; None: one per head
    kv_channels: Optional[int] = None            # head dim; None: hidden_size / heads
    normalization: str = "RMSNorm"               # RMSNorm | LayerNorm
    layernorm_epsilon: float = 1e-5
    activation: str = "swiglu"                   # swiglu | gelu | squared_relu
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    position_embedding_type: str = "rope"        # rope | learned_absolute | none
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    # Llama 3.x RoPE frequency scaling: Hugging Face's rope_type "llama3", megatron-core's RotaryEmbedding
    # rope_scaling (models/builder.py). Wavelengths longer than original / low_freq_factor are stretched by
    # factor, those shorter than original / high_freq_factor are kept, the ones between are interpolated.
    # Llama-3.1: factor 8, Llama-3.2: factor 32; both low 1, high 4, original 8192 (recipes/model/llama3*.yaml)
    rope_scaling: bool = False                   # true: Llama 3 scaling with the four keys below (needs rope)
    rope_scaling_factor: float = 8.0             # config.json rope_scaling.factor (>= 1)
    rope_low_freq_factor: float = 1.0            # config.json rope_scaling.low_freq_factor (> 0)
    rope_high_freq_factor: float = 4.0           # config.json rope_scaling.high_freq_factor (> low_freq_factor)
    rope_original_max_position_embeddings: int = 8192  # config.json rope_scaling.original_max_position_embeddings
    tie_embeddings: bool = True                  # share the input embedding and output layer weights
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128      # Megatron pads the vocabulary to a multiple of this x TP
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_grouped_gemm: bool = False
    attention_backend: str = "auto"              # auto (TE if importable, else sdpa) | te | sdpa | local
    # FP8 of Transformer Engine's layers (needs the TE backend): null (off) | hybrid (e4m3 forward, e5m2 gradients)
    # | e4m3. The embedding, the output layer and the fused KD loss stay in bf16.
    fp8: Optional[str] = None
    fp8_recipe: str = "tensorwise"               # Hopper: tensorwise (current scaling) | delayed | blockwise
    # Transformer Engine's FP8 attention (cuDNN) as well; with fp8_recipe=delayed (TE has no FP8 attention for
    # current scaling on Hopper). Not for models with attention sinks / sliding windows.
    fp8_attention: bool = False
    recompute_granularity: Optional[str] = None  # null | full | selective
    recompute_method: Optional[str] = None       # uniform | block (with full)
    recompute_num_layers: Optional[int] = None
    # gpt-oss (models/gpt_oss.py maps these onto TransformerConfig): GPT-OSS's attention sinks,
    # sliding window, clamped GLU and YaRN (recipes/model/gpt_oss_20b.yaml); the defaults turn them off
    softmax_type: str = "vanilla"                # vanilla | learnable (per-head sinks) | off-by-one
    window_size: Optional[list] = None           # [left, 0]: keys i - left .. i (HF sliding_window W: [W - 1, 0])
    window_attn_skip_freq: Optional[int] = None  # every Nth layer full attention (GPT-OSS: 2); null: all windowed
    activation_func_clamp_value: Optional[float] = None  # clamped GLU (GPT-OSS: 7.0)
    glu_linear_offset: float = 0.0               # + this on the GLU's linear half (GPT-OSS: 1.0)
    yarn: dict = field(default_factory=dict)     # position_embedding_type=yarn: megatron's yarn_* without the prefix
    megatron: dict = field(default_factory=dict)  # any other TransformerConfig field, passed through as is
    # a local Hugging Face checkpoint: architecture (config.json, overriding the keys above)
    # and weights through Megatron-Bridge's AutoBridge (megatron_kd/hf); null = the keys above, random init
    hf_path: Optional[str] = None


@dataclass
class TeacherConfig(ModelConfig):
    """The teacher's architecture plus where its weights come from (online mode and cache building)."""
    load: Optional[str] = None                   # dist_checkpointing dir (a `megatron-kd train` save dir)


@dataclass
class ParallelConfig:
    tp: int = 1                                  # tensor parallel
    pp: int = 1                                  # pipeline parallel (GPU only: Megatron's schedules)
    vpp: Optional[int] = None                    # virtual pipeline stages per rank
    cp: int = 1                                  # context parallel (needs TE attention)
    ep: int = 1                                  # expert parallel (MoE)
    etp: Optional[int] = None                    # expert tensor parallel
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True       # Megatron's DistributedOptimizer (GPU)
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False


@dataclass
class DataConfig:
    kind: str = "mock"                           # mock | indexed
    path: Any = field(default=None, metadata=RECIPE_SETS)  # indexed: prefix (or list: weight, prefix, ...) of
                                                 # .bin/.idx; null: none (mock data)
    tokenizer: Optional[str] = None              # a tokenizers JSON file (`megatron-kd data prepare` writes one)
    vocab_size: Optional[int] = None             # unpadded vocabulary; None: from the tokenizer
    seq_length: int = 128
    split: str = "969,30,1"
    seed: int = 1234
    eod_id: Optional[int] = None                 # None: the tokenizer's <|endoftext|> (mock: vocab_size - 1)
    eod_mask_loss: bool = False
    index_cache: Optional[str] = None            # where GPTDataset writes its index .npy files
    num_workers: int = 0                         # DataLoader worker processes per rank
    eval_samples: Optional[int] = None           # None: train.eval_iters x global_batch_size


@dataclass
class OfflineKD(KDLoss):
    """The keys of offline KD that a recipe's `kd` section and a Bridge YAML's `kd` section share: the loss keys
    (loss.KDLoss) plus the cache and how it is read. One name and one default each, in both dialects."""
    cache: Optional[str] = field(default=None, metadata=RECIPE_SETS)  # offline: the teacher top-K cache
                                                 # directory; null: none (online and ce modes)
    top_k: Optional[int] = None                  # K to train with; null: the cache's K (online and building a
                                                 # cache need a number)
    check_tokens: bool = True                    # compare each sample's token hash with the cache's
    log_ce: bool = False                         # also report the student's CE in KD modes (one forward-only
                                                 # output-layer pass per micro-batch; not free at 32K x 128K)


@dataclass
class KDConfig(OfflineKD):
    """The recipe's `kd` section: OfflineKD's keys plus the mode and where the teacher's targets come from."""
    mode: str = "offline"                        # offline (top-K cache) | online (teacher beside) | ce (labels only)
    build_cache: bool = False                    # offline: build the cache from `teacher` first when it is missing
    cache_encoding: str = "fp16"                 # when building: fp16 | fp32 | compact | topp | sampled
    cache_top_p: Optional[float] = None          # topp: per position the fewest ids (<= top_k) holding this mass
    cache_min_k: Optional[int] = None            # topp: keep at least this many ids (null: 1)
    cache_samples: Optional[int] = None          # sampled: N draws per position from the whole distribution
    cache_sample_seed: Optional[int] = None      # sampled: the draws' seed (null: 0)
    teacher_id: Optional[str] = None             # offline: the cache's teacher ("name" or "name@weights_hash");
                                                 # a cache from another teacher is refused


@dataclass
class TrainConfig:
    iters: int = 100
    micro_batch_size: int = 4
    global_batch_size: int = 8
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 0
    lr_decay_style: str = "cosine"               # constant | linear | cosine | inverse-square-root | WSD
    lr_decay_iters: Optional[int] = None         # None: iters
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    precision: str = "fp32"                      # fp32 | bf16 | fp16
    optimizer: str = "adam"                      # adam (Megatron's) | lean_adam (bf16: 12 B/param, lean_adam.py)
    exp_avg_dtype: str = "bf16"                  # lean_adam moments: fp32 | bf16
    exp_avg_sq_dtype: str = "fp32"
    seed: int = 1234
    save: Optional[str] = None                   # checkpoint dir; None: <hydra run dir>/checkpoints
    load: Optional[str] = None                   # resume from the latest checkpoint here if any; None: save
    pretrained: Optional[str] = None             # initialize the student's weights (not the optimizer) from here
    save_interval: Optional[int] = None          # None: only at the end
    save_at_end: bool = True                     # false: no final checkpoint (a speed / memory measurement only)
    export_hf: Optional[str] = None              # at the end, the student as an HF checkpoint here (model.hf_path runs)
    stop_at: Optional[int] = None                # stop (with a checkpoint) after this iteration, keep the schedule
    log_interval: int = 10
    eval_interval: Optional[int] = None          # None: only at the end
    eval_iters: int = 2
    progress: bool = True                        # console progress bar (rank 0)
    tensorboard: bool = True                     # <save>/tensorboard when tensorboard is installed
    device: str = "auto"                         # auto | cuda | cpu
    nonfinite: str = "stop"                      # NaN/inf loss or gradients: stop | skip (the update, said on the console)
    resume_changes: list = field(default_factory=list)  # keys a resume may change on purpose (recipe/resume_keys.py)


@dataclass
class QuantConfig:
    """The student quantized with NVIDIA ModelOpt (fake quantization: the weights stay in train.precision, each
    linear layer's weights and inputs pass through quantizers) and then trained: QAT in kd=ce, QAD otherwise."""
    format: str = "none"                         # none | fp8 | int8 | int4_awq | w4a16_awq | w4a8_awq | nvfp4 (GPU)
    calib_samples: int = 64                      # training samples the quantizers are calibrated on (amax, AWQ)


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
