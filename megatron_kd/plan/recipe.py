"""Read a `megatron-kd train` recipe (a shipped recipe by name or a .yaml path; the schema of recipes/README.md)
into what the plan needs.

The recipe is composed exactly as training composes it (megatron_kd.recipe.compose.compose: Hydra's compose API
over the schema, so a key the schema lacks is refused by name, train.save set so `${hydra:run.dir}` never resolves), its
`???` placeholders (kd.cache, data.path: irrelevant to memory) become null, and it is merged into the schema
dataclasses of megatron_kd.recipe.schema (to_recipe: schema defaults for missing keys, unknown keys refused).
Every key is then read as megatron_kd/models/builder.py and optim/setup.py read it:

  model / teacher    a ModelShape: ffn_hidden_size null = 4 x hidden, num_query_groups null = one per head,
                     kv_channels null = hidden / heads, activation swiglu = gated MLP, tie_embeddings (default true),
                     moe_ffn_hidden_size null = ffn_hidden_size (Megatron's default), learned_absolute positions
                     = data.seq_length rows; vocabulary = data.vocab_size (else the data.tokenizer file's)
  model.recompute_*  granularity null = no recompute; selective; full + method block = recompute_num_layers
                     layers per stage; full + uniform (or no method) = every layer
  parallel           tp, pp, cp, ep, etp (null = tp), sequence_parallel (only with tp > 1, as in models/builder.py),
                     use_distributed_optimizer; data parallel = world size / (tp x pp x cp), the world size
                     coming from `--gpus` (not a recipe key; default: the smallest world the layout runs on)
  train              micro_batch_size; global_batch_size / (micro_batch_size x dp) micro-batches per step
                     (counted once dp is known, see RecipePlan.training_for); precision bf16/fp16 -> fp32 grads
  data.seq_length    tokens per sample
  model.attention_backend, fp8, fp8_recipe, fp8_attention (model.megatron's fp8 keys win, as in the builder)
                     the layers: te (auto too: see layer_spec), in bf16 or FP8, or sdpa (megatron-core's local
                     spec with SDPA; local is planned as sdpa)
  kd                 mode, top_k, impl (auto = what auto picks on a GPU: fused)
"""
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..recipe.targets import TargetSource
from ..rules import DEFAULT_TOP_K
from .memory import Training, loss_impls
from .shapes import Layout, ModelShape


def recipe_path(name: str) -> Path | None:
    """The recipe file a name refers to (recipe.compose.recipe_file), or None."""
    from megatron_kd.recipe.compose import recipe_file
    return recipe_file(name)


def _missing_to_none(cfg) -> None:
    """Replace `???` (mandatory values the plan does not need: kd.cache, data.path) by null, in place."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    if isinstance(cfg, DictConfig):
        for k in list(cfg.keys()):
            if OmegaConf.is_missing(cfg, k):
                cfg[k] = None
            else:
                _missing_to_none(cfg._get_node(k))
    elif isinstance(cfg, ListConfig):
        for i in range(len(cfg)):
            if OmegaConf.is_missing(cfg, i):
                cfg[i] = None
            else:
                _missing_to_none(cfg._get_node(i))


def _cache_top_k(kd, notes: list) -> int:
    """kd.top_k=null trains with the cache's K: read it from a finished cache, else plan for the default K."""
    from megatron_kd.cache.format import MANIFEST, is_finished
    if is_finished(kd.cache):
        with open(Path(kd.cache) / MANIFEST) as f:
            return int(json.load(f)["top_k"])
    notes.append(f"kd.top_k=null (the cache's K) and no finished cache at kd.cache: planned at K={DEFAULT_TOP_K}")
    return DEFAULT_TOP_K


def load_recipe(name: str, overrides=(), skipped: list | None = None):
    """The recipe as megatron_kd.recipe.schema.Recipe dataclasses (composed as `megatron-kd train` does), checked
    as `megatron-kd train` checks it for another machine (recipe/checks.check_recipe with cuda=None: what training
    refuses, plan refuses with the same sentence); the checks left to that machine are appended to `skipped`."""
    from omegaconf import OmegaConf, open_dict
    from megatron_kd.recipe.checks import check_recipe
    from megatron_kd.recipe.schema import to_recipe
    from megatron_kd.recipe.compose import compose, missing_keys, recipes_dir
    path = recipe_path(name)
    if path is None:
        raise FileNotFoundError(f"no recipe {name!r} (a shipped recipe's name or a .yaml path)")
    target = str(path.resolve()) if Path(name).suffix in (".yaml", ".yml") or path.parent != recipes_dir() \
        else path.stem
    cfg = compose(target, list(overrides), save="runs/plan")
    later = missing_keys(cfg)
    with open_dict(cfg):
        _missing_to_none(cfg)
        if "hydra" in cfg:
            del cfg["hydra"]
    r = to_recipe(OmegaConf.create(OmegaConf.to_container(cfg, resolve=False)))
    left = check_recipe(r, None, None, later)
    if skipped is not None:
        skipped += left
    return r


def vocab_size(r) -> int:
    """The unpadded vocabulary: data.vocab_size, else the data.tokenizer file's (as megatron_kd.data.datasets),
    checked against kd.top_k as training checks it."""
    from ..recipe.checks import check_top_k_vocab
    v = _vocab_size(r)
    check_top_k_vocab(r, v)
    return v


def _vocab_size(r) -> int:
    d = r.data
    if d.vocab_size is not None:
        return int(d.vocab_size)
    if d.tokenizer:
        try:
            from tokenizers import Tokenizer
            return Tokenizer.from_file(str(d.tokenizer)).get_vocab_size()
        except Exception as e:
            raise ValueError(f"data.vocab_size is null and data.tokenizer={d.tokenizer!r} cannot be read ({e}); "
                             "give data.vocab_size=N") from None
    raise ValueError("the recipe gives no vocabulary: set data.vocab_size (or data.tokenizer)")


def shape_from_config(m, vocab: int, seq_length: int) -> ModelShape:
    """ModelShape of a ModelConfig/TeacherConfig, with models/builder.py's defaults for its null keys."""
    mg = dict(m.megatron or {})
    heads = m.num_attention_heads
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    experts = int(m.num_moe_experts or 0)
    freq = mg.get("moe_layer_freq", 1)
    if not isinstance(freq, int):
        raise ValueError(f"model.megatron.moe_layer_freq={freq!r}: the plan models an integer frequency only")
    return ModelShape(
        name=m.name, num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=heads,
        num_query_groups=m.num_query_groups or heads, kv_channels=m.kv_channels or m.hidden_size // heads,
        ffn_hidden_size=ffn, vocab_size=vocab, tie_embeddings=bool(m.tie_embeddings),
        activation=m.activation, normalization=m.normalization,
        add_bias_linear=bool(m.add_bias_linear), add_qkv_bias=bool(m.add_qkv_bias),
        qk_layernorm=bool(m.qk_layernorm), num_moe_experts=experts,
        moe_router_topk=int(m.moe_router_topk) if experts else 0,
        moe_ffn_hidden_size=int(m.moe_ffn_hidden_size or ffn) if experts else 0,
        moe_shared_expert_intermediate_size=int(mg.get("moe_shared_expert_intermediate_size") or 0) if experts else 0,
        moe_layer_freq=freq if experts else 1,
        learned_pos_emb=seq_length if m.position_embedding_type == "learned_absolute" else 0,
        attention_sinks=m.softmax_type == "learnable")


def model_config(shape: ModelShape, layout: Layout = Layout(), recompute: str = "none",
                 recompute_layers: int | None = None, **fields):
    """The recipe `model` section (megatron_kd.recipe.schema.ModelConfig) of a ModelShape: the inverse of
    shape_from_config, so the planner's checks build their GPTModels with training's builder
    (megatron_kd.models.builder.build_gpt). `fields` sets any other ModelConfig field."""
    from megatron_kd.recipe.schema import ModelConfig
    s = shape
    mg = {}
    if s.is_moe and s.moe_shared_expert_intermediate_size:
        mg["moe_shared_expert_intermediate_size"] = s.moe_shared_expert_intermediate_size
    if s.is_moe and s.moe_layer_freq != 1:
        mg["moe_layer_freq"] = s.moe_layer_freq
    rc = {"none": {}, "selective": dict(recompute_granularity="selective"),
          "full": dict(recompute_granularity="full", recompute_method="uniform" if recompute_layers is None
                       else "block", recompute_num_layers=1 if recompute_layers is None else recompute_layers)}
    return ModelConfig(
        name=s.name, num_layers=s.num_layers, hidden_size=s.hidden_size, ffn_hidden_size=s.ffn_hidden_size,
        num_attention_heads=s.num_attention_heads, num_query_groups=s.num_query_groups, kv_channels=s.kv_channels,
        normalization=s.normalization, activation=s.activation, add_bias_linear=s.add_bias_linear,
        add_qkv_bias=s.add_qkv_bias, qk_layernorm=s.qk_layernorm, tie_embeddings=s.tie_embeddings,
        position_embedding_type="learned_absolute" if s.learned_pos_emb else "rope",
        make_vocab_size_divisible_by=layout.vocab_divisible_by,
        num_moe_experts=s.num_moe_experts or None, moe_router_topk=s.moe_router_topk if s.is_moe else 2,
        moe_ffn_hidden_size=s.moe_ffn_hidden_size if s.is_moe else None, megatron=mg,
        **({'softmax_type': 'learnable'} if s.attention_sinks else {}), **rc[recompute], **fields)


def parallel_config(layout: Layout):
    """The recipe `parallel` section of a Layout (data parallel is the world size's, not a recipe key)."""
    from megatron_kd.recipe.schema import ParallelConfig
    return ParallelConfig(tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, etp=layout.etp,
                          sequence_parallel=layout.sp)


def recompute_of(m) -> tuple:
    """(recompute, recompute_layers) of model.recompute_granularity / _method / _num_layers, as Megatron runs it
    (what it refuses: recipe/checks.check_recompute)."""
    from ..recipe.checks import check_recompute
    check_recompute(m, "model")
    g = m.recompute_granularity
    if g is None:
        return "none", None
    if g == "selective":
        return "selective", None
    if m.recompute_method == "block":
        return "full", int(m.recompute_num_layers)
    return "full", None   # uniform: every layer, in groups of recompute_num_layers


def layer_spec(m, shape: ModelShape) -> tuple[dict, list]:
    """The Training fields of the layers a model section builds on (spec, fp8, fp8_attention, te_attention), read
    as models/builder.py reads them (recipe/fp8.fp8_fields), and notes that say what the
    plan assumed.

    attention_backend=auto builds Transformer Engine's spec where TE imports and the local spec with SDPA where
    it does not; the plan cannot know the training machine, so it plans TE's, which our GPU container (NeMo's
    image, docker/Dockerfile) and NeMo / Megatron-Bridge environments have, and says how to plan the other.
    The exception is runtime/te_compat's: models with sinks / windows keep megatron-kd's core attention under
    TE's linears."""
    from ..recipe.checks import check_layer_settings
    from ..recipe.fp8 import fp8_fields
    from ..runtime.te_compat import te_attention_unverified
    check_layer_settings(m, "model")  # what training refuses is not planned
    f8 = fp8_fields(m)
    fp8, fp8_recipe = f8.get("fp8"), f8.get("fp8_recipe")
    fp8_attention = bool(f8.get("fp8_dot_product_attention"))
    notes = []
    backend = m.attention_backend
    if backend == "auto":
        backend = "te"
        notes.append("model.attention_backend=auto: planned on Transformer Engine's layers, which auto builds where "
                     "TE imports (the NeMo container); where it does not, auto builds the local spec with SDPA: "
                     "plan that with model.attention_backend=sdpa")
    fields = dict(spec="te" if backend == "te" else "sdpa", fp8=fp8_recipe if fp8 else None,
                  fp8_attention=fp8_attention, te_attention=not te_attention_unverified(m))
    if backend == "local":
        notes.append("model.attention_backend=local: planned as the SDPA spec; megatron-core's own attention also "
                     "keeps its [heads, s, s] probabilities for backward, which the plan does not count")
    if backend != "te":
        return fields, notes   # FP8 here is refused by Training.check (FP8 runs in TE's layers only)
    if fp8 and shape.is_moe:
        notes.append(f"model.fp8={fp8}: the experts' saved activations are counted in bf16 (TE's FP8 copies of "
                     "their inputs are not modelled); their FP8 weight copies are")
    if fp8 and fp8_recipe in ("blockwise", "mxfp8"):
        notes.append(f"model.fp8_recipe={fp8_recipe}: its FP8 copies and block scales are modelled from Transformer "
                     "Engine's source, not yet measured (tensorwise and delayed are)")
    return fields, notes


@dataclass
class RecipePlan:
    """What the plan reads from a recipe; dp (the world size) and the micro-batch count come later."""
    shape: ModelShape
    layout: Layout              # dp=1 until the world size is known (with_world)
    training: Training          # num_microbatches=1 until then (training_for)
    teacher: ModelShape | None
    global_batch_size: int
    precision: str
    vpp: int | None = None
    notes: list = field(default_factory=list)
    cache_teacher: ModelShape | None = None  # offline with kd.build_cache: the teacher whose cache the run builds

    def min_world(self) -> int:
        """The smallest world size the layout runs on: a multiple of tp*pp*cp and of etp*ep*pp."""
        lay = self.layout
        return math.lcm(lay.tp * lay.pp * lay.cp, lay.expert_tp * lay.ep * lay.pp)

    def training_for(self, layout: Layout) -> Training:
        """The step at data-parallel size layout.dp: global_batch / (micro_batch x dp) micro-batches."""
        from ..recipe.checks import check_batch
        micro = check_batch(self.global_batch_size, self.training.micro_batch, layout.dp)
        return replace(self.training, num_microbatches=micro)


def from_recipe(r) -> RecipePlan:
    """RecipePlan of a megatron_kd.recipe.schema.Recipe."""
    m, p, t, kd, d = r.model, r.parallel, r.train, r.kd, r.data
    vocab = vocab_size(r)
    shape = shape_from_config(m, vocab, d.seq_length)
    targets = TargetSource.of(kd)
    teacher = shape_from_config(r.teacher, vocab, d.seq_length) if targets.teacher_each_step else None
    layout = Layout(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, dp=1,
                    sequence_parallel=bool(p.sequence_parallel),
                    vocab_divisible_by=m.make_vocab_size_divisible_by)
    rc, rc_layers = recompute_of(m)
    notes = []
    tr = dict(seq_len=d.seq_length, micro_batch=t.micro_batch_size, recompute=rc, recompute_layers=rc_layers,
              distributed_optimizer=bool(p.use_distributed_optimizer), grad_fp32=True, optimizer=t.optimizer,
              moment_bytes=tuple(2 if x == "bf16" else 4 for x in (t.exp_avg_dtype, t.exp_avg_sq_dtype)),
              mode=kd.mode, topk=kd.top_k or _cache_top_k(kd, notes), quant=r.quant.format)
    if kd.impl in loss_impls():
        tr["loss"] = kd.impl
    elif kd.impl != "auto":
        raise ValueError(f"kd.impl={kd.impl!r}: use auto or one of {loss_impls()}")
    if teacher is not None:
        tr["teacher"] = teacher
    if t.precision == "fp32":
        notes.append("train.precision=fp32: the plan counts bf16 mixed precision (fp32 runs hold 4-byte weights "
                     "and no separate main params)")
    if p.vpp:
        notes.append(f"parallel.vpp={p.vpp}: interleaved pipeline stages are not modelled (1F1B counted)")
    from ..recipe.checks import check_layer_settings, check_quant
    if targets.needs_teacher:  # the teacher training (online) or the cache build (kd.build_cache) runs
        check_layer_settings(r.teacher, "teacher")
    check_quant(r)
    spec, spec_notes = layer_spec(m, shape)
    tr.update(spec)
    notes += spec_notes
    cache_teacher = shape_from_config(r.teacher, vocab, d.seq_length) if targets.builds_cache else None
    return RecipePlan(shape=shape, layout=layout, training=Training(**tr), teacher=teacher,
                      global_batch_size=t.global_batch_size, precision=t.precision, vpp=p.vpp, notes=notes,
                      cache_teacher=cache_teacher)
