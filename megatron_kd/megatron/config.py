"""The recipe schema (what `recipes/` may contain) and the checks run before any work.

A recipe is composed by Hydra from the groups model, teacher, parallel, data, kd, train (recipes/README.md).
`to_recipe` merges it into the dataclasses below, so a misspelt or unknown key fails at once with its full
name, then checks what depends on several sections (TP dividing heads, batch sizes, mode-specific keys).
"""
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from ..loss.options import KDLoss

MODES = ("offline", "online", "ce")
ATTENTION_BACKENDS = ("auto", "te", "sdpa", "local")
PRECISIONS = ("fp32", "bf16", "fp16")
GATED_ACTIVATIONS = ("swiglu", "quick_geglu")     # gated MLPs (fc1 is 2 x ffn wide); quick_geglu: GPT-OSS


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
    tie_embeddings: bool = True                  # share the input embedding and output layer weights
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128      # Megatron pads the vocabulary to a multiple of this x TP
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_grouped_gemm: bool = False
    attention_backend: str = "auto"              # auto (TE if importable, else sdpa) | te | sdpa | local
    recompute_granularity: Optional[str] = None  # null | full | selective
    recompute_method: Optional[str] = None       # uniform | block (with full)
    recompute_num_layers: Optional[int] = None
    # gpt-oss (issue 17; megatron/gpt_oss.py maps these onto TransformerConfig): GPT-OSS's attention sinks,
    # sliding window, clamped GLU and YaRN (recipes/model/gpt_oss_20b.yaml); the defaults turn them off
    softmax_type: str = "vanilla"                # vanilla | learnable (per-head sinks) | off-by-one
    window_size: Optional[list] = None           # [left, 0]: keys i - left .. i (HF sliding_window W: [W - 1, 0])
    window_attn_skip_freq: Optional[int] = None  # every Nth layer full attention (GPT-OSS: 2); null: all windowed
    activation_func_clamp_value: Optional[float] = None  # clamped GLU (GPT-OSS: 7.0)
    glu_linear_offset: float = 0.0               # + this on the GLU's linear half (GPT-OSS: 1.0)
    yarn: dict = field(default_factory=dict)     # position_embedding_type=yarn: megatron's yarn_* without the prefix
    megatron: dict = field(default_factory=dict)  # any other TransformerConfig field, passed through as is
    # hf-ckpt (issue 16): a local Hugging Face checkpoint: architecture (config.json, overriding the keys above)
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
    teacher_tp: Optional[int] = None             # online mode: must equal tp for now (checked)


@dataclass
class DataConfig:
    kind: str = "mock"                           # mock | indexed
    path: Any = None                             # indexed: prefix (or list: weight, prefix, ...) of .bin/.idx
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
class KDConfig(KDLoss):
    """The `kd` section: the loss keys (kl_weight, ce_weight, temperature, tail, impl, chunk_size: loss.KDLoss)
    plus the mode and where the teacher's targets come from."""
    mode: str = "offline"                        # offline (top-K cache) | online (teacher beside) | ce (labels only)
    cache: Optional[str] = None                  # offline: the teacher top-K cache directory
    build_cache: bool = False                    # offline: build the cache from `teacher` first when it is missing
    cache_encoding: str = "fp16"                 # when building: fp16 | compact
    top_k: int = 32
    check_tokens: bool = True                    # compare each sample's token hash with the cache's
    teacher_id: Optional[str] = None             # offline: the cache's teacher ("name" or "name@weights_hash");
                                                 # a cache from another teacher is refused (data-safety hook)
    log_ce: bool = True                          # report the student's CE in KD modes (one forward-only output-
                                                 # layer pass per micro-batch; large GPU runs may turn it off)


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
    export_hf: Optional[str] = None              # at the end, the student as an HF checkpoint here (model.hf_path runs)
    stop_at: Optional[int] = None                # stop (with a checkpoint) after this iteration, keep the schedule
    log_interval: int = 10
    eval_interval: Optional[int] = None          # None: only at the end
    eval_iters: int = 2
    progress: bool = True                        # console progress bar (rank 0)
    tensorboard: bool = True                     # <save>/tensorboard when tensorboard is installed
    device: str = "auto"                         # auto | cuda | cpu
    nonfinite: str = "stop"                      # NaN/inf loss or gradients: stop | skip (the update, said on the console)
    resume_changes: list = field(default_factory=list)  # keys a resume may change on purpose (megatron/guards.py)


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    kd: KDConfig = field(default_factory=KDConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


class RecipeError(ValueError):
    """A recipe problem, found before any work; the message names the key and the fix."""


def _schema_error(e) -> RecipeError:
    key = getattr(e, "full_key", None) or ""
    msg = (getattr(e, "msg", None) or str(e)).splitlines()[0]  # first-hour: OmegaConf appends its internals
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
    if not OmegaConf.is_config(cfg):
        cfg = OmegaConf.create(cfg)
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    schema = OmegaConf.structured(Recipe)
    try:
        merged = OmegaConf.merge(schema, cfg)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _schema_error(e) from None


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise RecipeError(msg)


def check_model(m: ModelConfig, section: str, tp: int) -> None:
    _need(m.num_layers >= 1, f"{section}.num_layers={m.num_layers} must be >= 1")
    _need(m.num_attention_heads >= 1 and m.hidden_size >= 1, f"{section}: hidden_size and heads must be >= 1")
    if m.kv_channels is None:
        _need(m.hidden_size % m.num_attention_heads == 0,
              f"{section}.hidden_size={m.hidden_size} must divide by {section}.num_attention_heads="
              f"{m.num_attention_heads} (or set {section}.kv_channels)")
    _need(m.num_attention_heads % tp == 0,
          f"{section}.num_attention_heads={m.num_attention_heads} must divide by parallel.tp={tp}: each TP rank "
          "holds whole heads; pick a TP size that divides the head count")
    groups = m.num_query_groups or m.num_attention_heads
    _need(m.num_attention_heads % groups == 0,
          f"{section}.num_query_groups={groups} must divide {section}.num_attention_heads={m.num_attention_heads}")
    _need(groups % tp == 0, f"{section}.num_query_groups={groups} must divide by parallel.tp={tp}")
    _need(m.normalization in ("RMSNorm", "LayerNorm"), f"{section}.normalization={m.normalization!r}: "
          "use RMSNorm or LayerNorm")
    _need(m.activation in ("swiglu", "gelu", "squared_relu", "quick_geglu"), f"{section}.activation="
          f"{m.activation!r}: use swiglu, gelu, squared_relu or quick_geglu (GPT-OSS)")
    _need(m.position_embedding_type in ("rope", "yarn", "learned_absolute", "none"),
          f"{section}.position_embedding_type={m.position_embedding_type!r}: use rope, yarn, learned_absolute or none")
    from . import gpt_oss  # gpt-oss: sinks, window, clamp, YaRN fields
    try:
        gpt_oss.check(m, section)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    _need(m.attention_backend in ATTENTION_BACKENDS,
          f"{section}.attention_backend={m.attention_backend!r}: use one of {ATTENTION_BACKENDS}")
    _need(m.make_vocab_size_divisible_by >= 1, f"{section}.make_vocab_size_divisible_by must be >= 1")
    if m.hf_path:  # hf-ckpt: the directory here; Bridge, architecture and layout in megatron_kd.hf.recipe.resolve
        from ..hf import check_hf_dir
        check_hf_dir(m.hf_path, f"{section}.hf_path")
    if m.megatron:
        from megatron.core.transformer.transformer_config import TransformerConfig
        known = {f.name for f in fields(TransformerConfig)}
        bad = sorted(set(m.megatron) - known)
        _need(not bad, f"unknown recipe key(s) {', '.join(f'{section}.megatron.{k}' for k in bad)}: "
              f"{section}.megatron passes fields to Megatron's TransformerConfig, which has no such field")


def padded_vocab_size(vocab_size: int, m: ModelConfig, tp: int) -> int:
    """Megatron's rule: round up to a multiple of make_vocab_size_divisible_by x TP."""
    step = m.make_vocab_size_divisible_by * tp
    return -(-vocab_size // step) * step


def check_vocab(vocab_size: int, m: ModelConfig, section: str, tp: int) -> int:
    if m.make_vocab_size_divisible_by == 1 and vocab_size % tp:
        raise RecipeError(f"the vocabulary ({vocab_size} ids: data.tokenizer / data.vocab_size) does not divide by "
                          f"parallel.tp={tp}, and {section}.make_vocab_size_divisible_by=1 asks for no padding; set "
                          f"{section}.make_vocab_size_divisible_by (e.g. 128): Megatron pads the vocabulary and the "
                          "padding rows stay out of the loss")
    padded = padded_vocab_size(vocab_size, m, tp)
    _need(padded % tp == 0, f"the padded vocabulary {padded} ({section}.make_vocab_size_divisible_by="
          f"{m.make_vocab_size_divisible_by}) must divide by parallel.tp={tp}")
    return padded


def check_world(r: Recipe, world_size: int) -> int:
    """The data-parallel size of the recipe's layout on world_size ranks."""
    p, t = r.parallel, r.train
    model_parallel = p.tp * p.pp * p.cp
    _need(world_size % model_parallel == 0,
          f"{world_size} processes do not divide into parallel.tp x parallel.pp x parallel.cp = {model_parallel}; "
          f"launch a multiple of {model_parallel} processes (torchrun --nproc-per-node)")
    dp = world_size // model_parallel
    _need(t.global_batch_size % (t.micro_batch_size * dp) == 0,
          f"train.global_batch_size={t.global_batch_size} must divide by train.micro_batch_size x data-parallel "
          f"size = {t.micro_batch_size} x {dp}")
    return dp


def check_recipe(r: Recipe, world_size: int | None = 1, cuda: bool = False) -> None:
    """Cross-section checks that need no data or model; raise RecipeError naming the key.
    The world-size check comes last (world_size=None skips it)."""
    p, t, kd, d = r.parallel, r.train, r.kd, r.data
    for k in ("tp", "pp", "cp", "ep"):
        _need(getattr(p, k) >= 1, f"parallel.{k}={getattr(p, k)} must be >= 1")
    check_model(r.model, "model", p.tp)
    _need(kd.mode in MODES, f"kd.mode={kd.mode!r}: use one of {MODES}")
    if kd.mode != "ce":
        _need(kd.top_k >= 1, f"kd.top_k={kd.top_k} must be >= 1")
        _need(kd.temperature > 0, f"kd.temperature={kd.temperature} must be > 0")
    if kd.mode == "online" or (kd.mode == "offline" and kd.build_cache):
        check_model(r.teacher, "teacher", p.tp)
    if kd.mode == "offline":
        _need(bool(kd.cache), "kd.cache is required in offline mode: the teacher top-K cache directory "
              "(build one with `megatron-kd cache build`, or set kd.build_cache=true)")
    if kd.mode == "online":
        _need(p.teacher_tp in (None, p.tp), f"parallel.teacher_tp={p.teacher_tp} must equal parallel.tp={p.tp}: "
              "the online teacher shares the student's tensor-parallel group")
    try:
        kd.loss_options()
    except ValueError as e:
        raise RecipeError(f"kd: {e}") from None
    _need(d.kind in ("mock", "indexed"), f"data.kind={d.kind!r}: use mock or indexed")
    if d.kind == "indexed":
        _need(bool(d.path), "data.path is required with data.kind=indexed: the .bin/.idx prefix "
              "(`megatron-kd data prepare` writes one)")
    else:
        _need(d.vocab_size is not None or d.tokenizer is not None,
              "data.vocab_size is required with data.kind=mock (or give data.tokenizer)")
    _need(d.seq_length >= 2, f"data.seq_length={d.seq_length} must be >= 2")
    _need(d.seq_length % (2 * p.cp) == 0 or p.cp == 1,
          f"data.seq_length={d.seq_length} must divide by 2 x parallel.cp={2 * p.cp} (Megatron's load-balanced split)")
    if p.sequence_parallel:
        _need(d.seq_length % p.tp == 0, f"data.seq_length={d.seq_length} must divide by parallel.tp={p.tp} "
              "with parallel.sequence_parallel")
    _need(t.iters >= 1, f"train.iters={t.iters} must be >= 1")
    from .guards import check_train  # the train section's numbers and policies
    check_train(t)
    _need(t.micro_batch_size >= 1, f"train.micro_batch_size={t.micro_batch_size} must be >= 1")
    _need(t.precision in PRECISIONS, f"train.precision={t.precision!r}: use one of {PRECISIONS}")
    _need(t.device in ("auto", "cuda", "cpu"), f"train.device={t.device!r}: use auto, cuda or cpu")
    _need(t.optimizer in ("adam", "lean_adam"), f"train.optimizer={t.optimizer!r}: use adam or lean_adam")
    if t.optimizer == "lean_adam":
        _need(t.precision == "bf16", f"train.optimizer=lean_adam updates bf16 weights; set train.precision=bf16 "
              f"(got {t.precision}) or use train.optimizer=adam")
        for k in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            _need(getattr(t, k) in ("fp32", "bf16"), f"train.{k}={getattr(t, k)!r}: use fp32 or bf16")
        _need(t.exp_avg_sq_dtype == "fp32" or t.adam_beta2 <= 0.95,
              f"train.exp_avg_sq_dtype=bf16 with train.adam_beta2={t.adam_beta2}: bf16 rounds away the "
              f"second moment's per-step change (1 - beta2 = {1 - t.adam_beta2:.3g} < 0.4%); use "
              "train.exp_avg_sq_dtype=fp32 or adam_beta2 <= 0.95")
        _need(p.ep == 1, f"train.optimizer=lean_adam with parallel.ep={p.ep}: its one gradient-norm group "
              "would clip expert-parallel ranks differently; use train.optimizer=adam for expert parallelism")
    if not cuda:
        _need(p.pp == 1, f"parallel.pp={p.pp}: pipeline parallel needs GPUs (Megatron's schedules are CUDA-only); "
              "use parallel.pp=1 on CPU")
        _need(p.cp == 1, f"parallel.cp={p.cp}: context parallel attention needs Transformer Engine on GPUs; "
              "use parallel.cp=1 on CPU")
        _need(not p.sequence_parallel, "parallel.sequence_parallel=true needs GPUs (Megatron's norms refuse it "
              "without TE/apex); set it false on CPU")
        _need(t.precision == "fp32" or t.optimizer == "lean_adam", f"train.precision={t.precision} needs GPUs "
              "(Megatron's mixed-precision optimizer is CUDA-only); use train.precision=fp32 on CPU, or "
              "train.precision=bf16 with train.optimizer=lean_adam")
    if t.stop_at is not None:
        _need(1 <= t.stop_at <= t.iters, f"train.stop_at={t.stop_at} must be in [1, train.iters={t.iters}]")
    if world_size is not None:
        check_world(r, world_size)
