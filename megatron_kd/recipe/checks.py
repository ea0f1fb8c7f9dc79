"""Every check of a recipe that runs before any work; each raises RecipeError naming the key and the fix.

check_recipe: the sections alone and across each other (no data, no model). check_run: what needs the tokenizer's
size and the world size. check_model / check_vocab: one architecture section (student or teacher).

The commands that only plan a run (`megatron-kd plan`, `launch --dry-run`, a launch that runs on Slurm or in a
container) call check_recipe with cuda=None: every check that depends on the recipe alone runs as in training, so
they refuse what training refuses with the same sentence; what depends on the machine that runs it (its GPU,
Transformer Engine, ModelOpt, Triton) or reads its files (model.hf_path, kd.cache) is not run, and named in the list
check_recipe returns (`skipped`), which those commands print.
"""
import math
import os
from dataclasses import fields

import torch
import torch.distributed as dist

from .. import families
from ..kernels import fused_unavailable
from ..rules import padded_vocab_size, same_temperature, top_k_fits
from ..runtime import features  # looked up at call time: the one place a test fakes TE or apex importing
from ..runtime.te_compat import own_attention_cp_refusal, te_attention_refusal, te_attention_unverified
from .fp8 import fp8_fields, fp8_keys
from .resume_keys import resume_keys_all
from .. import quant_formats
from .schema import (ATTENTION_BACKENDS, FP8_FORMATS, FP8_RECIPES, PRECISIONS,
                     ModelConfig, Recipe, RecipeError)
from .targets import MODES, TargetSource


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise RecipeError(msg)


def _there(skipped: list | None, what: str) -> bool:
    """True when a check of the machine that runs the recipe is for another machine: `what` (the key and what it
    needs there) goes into `skipped` and the caller skips the check. skipped=None: the check runs here."""
    if skipped is None:
        return False
    if what not in skipped:
        skipped.append(what)
    return True


def check_model(m: ModelConfig, section: str, tp: int, skipped: list | None = None) -> None:
    """One architecture section. skipped: a list for a run on another machine (check_recipe's cuda=None): the
    checks of that machine's Transformer Engine and GPU, and of the files model.hf_path names, go there instead."""
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
    families.recipe_checks(m, section)  # each family's own fields (GPT-OSS: sinks, window, YaRN)
    check_rope_scaling(m, section)
    check_recompute(m, section)
    check_layer_settings(m, section)
    te_there = m.attention_backend == "te" and _there(skipped, f"{section}.attention_backend=te (Transformer "
                                                               "Engine there)")
    _need(te_there or m.attention_backend != "te" or features.te_available(),
          f"{section}.attention_backend=te needs Transformer Engine, which does not import here; set "
          f"{section}.attention_backend=auto (TE's layers where TE imports, else SDPA) or sdpa, or run in a "
          "container with TE (NeMo / Megatron-Bridge)")
    _need(m.make_vocab_size_divisible_by >= 1, f"{section}.make_vocab_size_divisible_by must be >= 1")
    check_fp8(m, section, skipped)
    if m.hf_path and not _there(skipped, f"{section}.hf_path={m.hf_path} (read there)"):
        # the directory here; Bridge, architecture and layout in recipe.hf.resolve
        from ..hf import check_hf_dir
        check_hf_dir(m.hf_path, f"{section}.hf_path")
    if m.megatron:
        from megatron.core.transformer.transformer_config import TransformerConfig
        known = {f.name for f in fields(TransformerConfig)}
        bad = sorted(set(m.megatron) - known)
        _need(not bad, f"unknown recipe key(s) {', '.join(f'{section}.megatron.{k}' for k in bad)}: "
              f"{section}.megatron passes fields to Megatron's TransformerConfig, which has no such field")


def check_layer_settings(m: ModelConfig, section: str) -> None:
    """The attention backend and FP8 keys as far as the machine does not matter (also for `megatron-kd plan`, on a
    machine that need not have TE): what check_model refuses of them anywhere is not planned either."""
    _need(m.attention_backend in ATTENTION_BACKENDS,
          f"{section}.attention_backend={m.attention_backend!r}: use one of {ATTENTION_BACKENDS}")
    check_fp8_settings(m, section)


def check_quant(r: Recipe, cuda: bool | None = None) -> None:
    """The quant section. cuda=None (`megatron-kd plan`, `launch --dry-run`: the machine that runs it is not this
    one): what is refused anywhere; else also what this machine lacks (quant_problem: its GPU, ModelOpt)."""
    _need(r.quant.calib_samples >= 1, f"quant.calib_samples={r.quant.calib_samples} must be >= 1")
    fmt = r.quant.format
    problem = quant_formats.unknown_problem(fmt) if cuda is None else quant_problem(fmt, cuda)
    _need(problem is None, problem)
    p = r.parallel
    _need(r.quant.format == "none" or (p.pp == 1 and not p.vpp), f"quant.format={r.quant.format} with parallel.pp="
          f"{p.pp}: a quantized student trains under TP and DP, not pipeline stages (each stage's quantizers would "
          "need their own state); set parallel.pp=1")
    check_quant_fp8(r)


def check_quant_fp8(r: Recipe) -> None:
    """ModelOpt's quantization (quant.format) and TE's FP8 of the student, which both quantize its linears."""
    fp8_key = fp8_keys(r.model, "model").get("fp8")
    _need(r.quant.format == "none" or not fp8_key, f"quant.format={r.quant.format} with {fp8_key}="
          f"{fp8_fields(r.model).get('fp8')}: ModelOpt's fake quantization and Transformer Engine's FP8 would both "
          f"quantize the same linear layers; set {fp8_key}=null")


def check_fp8_settings(m: ModelConfig, section: str) -> None:
    """The FP8 keys among themselves and with the model, wherever the recipe is read (also by `megatron-kd plan`,
    on a machine that need not have TE): FP8 runs in Transformer Engine's layers only, FP8 attention with delayed
    scaling only, and not for models whose attention TE's spec does not reproduce. The section's own keys, then
    what megatron-core gets (recipe/fp8.fp8_fields: `megatron:` may set FP8 too), each by the key that set it."""
    if m.fp8 is None:
        _need(not m.fp8_attention, f"{section}.fp8_attention=true needs FP8 layers: set {section}.fp8=hybrid "
              f"(and {section}.fp8_recipe=delayed), or {section}.fp8_attention=false")
    else:
        _need(m.fp8 in FP8_FORMATS, f"{section}.fp8={m.fp8!r}: use one of {FP8_FORMATS} (or null for bf16)")
    # checked with FP8 off too: a misspelt recipe must not wait until someone turns FP8 on
    _need(m.fp8_recipe in FP8_RECIPES, f"{section}.fp8_recipe={m.fp8_recipe!r}: use one of {FP8_RECIPES}")
    f8, key = fp8_fields(m), fp8_keys(m, section)
    if not f8:
        return
    fp8, recipe, attention = f8["fp8"], f8["fp8_recipe"], bool(f8["fp8_dot_product_attention"])
    _need(not te_attention_unverified(m), te_attention_refusal(key["fp8"], fp8))
    _need(fp8 in FP8_FORMATS, f"{key['fp8']}={fp8!r}: use one of {FP8_FORMATS} (or null for bf16)")
    _need(recipe in FP8_RECIPES, f"{key['fp8_recipe']}={recipe!r}: use one of {FP8_RECIPES}")
    # FP8 from the pass-through alone: the section's own fp8_recipe (the schema's default included) is not
    # passed to megatron-core, so a different one would be silently ignored
    source = key["fp8_recipe"] if ".megatron." in key["fp8_recipe"] else "megatron-core's default"
    _need(m.fp8 is not None or recipe == m.fp8_recipe,
          f"{key['fp8']}={fp8} runs the FP8 recipe {recipe} ({source}), not {section}.fp8_recipe={m.fp8_recipe}; "
          f"set {section}.fp8={fp8} instead of {key['fp8']} ({section}.fp8_recipe then applies), or "
          f"{section}.fp8_recipe={recipe}")
    _need(m.attention_backend in ("te", "auto"), f"{key['fp8']}={fp8} runs in Transformer Engine's layers but "
          f"{section}.attention_backend={m.attention_backend}; set {section}.attention_backend=te (or auto), or "
          f"{key['fp8']}=null")
    a, r = key["fp8_dot_product_attention"], key["fp8_recipe"]
    _need(not attention or recipe == "delayed",
          f"{a}=true with {r}={recipe}: Transformer Engine's FP8 attention runs with delayed scaling only (it has "
          f"no backend for {recipe}); set {r}=delayed, or {a}=false")


def check_fp8(m: ModelConfig, section: str, skipped: list | None = None) -> None:
    """FP8 runs in Transformer Engine's layers only, and each scaling recipe on the GPUs that have it."""
    check_fp8_settings(m, section)
    f8, key = fp8_fields(m), fp8_keys(m, section)
    if not f8 or _there(skipped, f"{key['fp8']}={f8['fp8']} (Transformer Engine and the GPU there)"):
        return
    _need(features.te_available(), f"{key['fp8']}={f8['fp8']} needs Transformer Engine on a GPU, which does not "
          f"import here; set {key['fp8']}=null (bf16), or run in a container with TE (NeMo / Megatron-Bridge)")
    if f8["fp8_recipe"] == "mxfp8":
        major = torch.cuda.get_device_capability()[0]
        _need(major >= 10, f"{key['fp8_recipe']}=mxfp8 needs a Blackwell GPU (compute capability 10+; this one "
              f"is {major}.x); use {key['fp8_recipe']}=tensorwise, delayed or blockwise")


def check_vocab(vocab_size: int, m: ModelConfig, section: str, tp: int) -> int:
    if m.make_vocab_size_divisible_by == 1 and vocab_size % tp:
        raise RecipeError(f"the vocabulary ({vocab_size} ids: data.tokenizer / data.vocab_size) does not divide by "
                          f"parallel.tp={tp}, and {section}.make_vocab_size_divisible_by=1 asks for no padding; set "
                          f"{section}.make_vocab_size_divisible_by (e.g. 128): Megatron pads the vocabulary and the "
                          "padding rows stay out of the loss")
    padded = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, tp)
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
    check_batch(t.global_batch_size, t.micro_batch_size, dp)
    return dp


def check_batch(global_batch_size: int, micro_batch_size: int, dp: int) -> int:
    """The micro-batches per step of each data-parallel rank (training, and `megatron-kd plan` at its world)."""
    _need(micro_batch_size >= 1, f"train.micro_batch_size={micro_batch_size} must be >= 1")
    _need(global_batch_size % (micro_batch_size * dp) == 0,
          f"train.global_batch_size={global_batch_size} must divide by train.micro_batch_size x data-parallel "
          f"size = {micro_batch_size} x {dp}")
    return global_batch_size // (micro_batch_size * dp)


def check_recipe(r: Recipe, world_size: int | None = 1, cuda: bool | None = False, later=()) -> list:
    """Cross-section checks that need no data or model; raise RecipeError naming the key.
    The world-size check comes last (world_size=None skips it).
    cuda=None: the run is planned for another machine (plan, launch --dry-run, Slurm, a container): what needs that
    machine or its files is not checked; returns what was skipped, each naming its key (else []). later: the keys
    the recipe leaves `???`, given there (their `required` checks are skipped)."""
    p = r.parallel
    skipped = [] if cuda is None else None
    for k in ("tp", "pp", "cp", "ep"):
        _need(getattr(p, k) >= 1, f"parallel.{k}={getattr(p, k)} must be >= 1")
    _need(p.etp is None or p.etp >= 1, f"parallel.etp={p.etp} must be >= 1, or null (= parallel.tp)")
    _need(p.vpp is None or p.vpp >= 1, f"parallel.vpp={p.vpp} must be >= 1, or null (no interleaving)")
    check_model(r.model, "model", p.tp, skipped)
    # megatron-core's MoE layer raises in the first training step otherwise (after any teacher pass)
    _need(not (r.model.num_moe_experts and p.tp > 1) or p.sequence_parallel,
          f"model.num_moe_experts={r.model.num_moe_experts} with parallel.tp={p.tp}: megatron-core trains MoE layers "
          "under tensor parallelism only with sequence parallelism; set parallel.sequence_parallel=true (GPUs), or "
          "parallel.tp=1 and spread the experts with parallel.ep")
    _need(p.cp == 1 or not te_attention_unverified(r.model), own_attention_cp_refusal("model", p.cp))
    _check_kd(r, skipped, later)
    _check_data(r, later)
    if r.data.tokenizer is None and r.data.vocab_size is not None:  # else check_run, once the tokenizer is read
        check_top_k_vocab(r, r.data.vocab_size)
    _check_train(r)
    _check_online(r, skipped)
    _check_export_source(r)
    if cuda is None and r.train.device == "cpu":
        cuda = False  # the machine there runs it on its CPU whatever it has
    elif cuda is None and r.train.device == "cuda":
        _there(skipped, "train.device=cuda (a GPU there)")
    if cuda is None:
        if r.kd.impl == "fused":
            _there(skipped, "kd.impl=fused (a GPU and Triton there)")
        if r.quant.format != "none":
            _there(skipped, f"quant.format={r.quant.format} (ModelOpt and a GPU there)")
        if r.train.device == "auto" and _refusal(_check_cpu, r):
            _there(skipped, f"train.device=auto (a GPU there: on a CPU, {_refusal(_check_cpu, r)})")
    else:
        _check_fused(r, cuda)
    check_quant(r, cuda)
    if cuda is False:
        _check_cpu(r)
    if world_size is not None:
        check_world(r, world_size)
    return skipped or []


def skipped_line(skipped: list) -> str:
    """What check_recipe(cuda=None) left to the machine that runs the recipe, as the planning commands print it."""
    return "not checked here, left to the machine that runs it: " + "; ".join(skipped)


def _refusal(check, *args) -> str | None:
    try:
        check(*args)
    except RecipeError as e:
        return str(e)
    return None


def _check_online(r: Recipe, skipped: list | None = None) -> None:
    """An online teacher: unpipelined beside the student, loaded from a checkpoint (a recipe planned for another
    machine may leave it to be given there, as the online recipes do)."""
    src = TargetSource.of(r.kd)
    if not src.teacher_each_step:
        return
    _need(r.parallel.cp == 1 or not te_attention_unverified(r.teacher), own_attention_cp_refusal("teacher",
                                                                                                r.parallel.cp))
    _need(r.parallel.pp == 1, "kd.mode=online runs with parallel.pp=1 (the teacher beside the student is not "
          "pipelined); use offline mode (a cache) with pipeline parallel")
    _need(bool(r.teacher.load or r.teacher.hf_path) or _there(skipped, "teacher.load=null (kd.mode=online: the "
          "teacher's checkpoint there, teacher.load or teacher.hf_path)"), "kd.mode=online needs teacher.load: the teacher's checkpoint "
          "directory (a `megatron-kd train` save dir), or teacher.hf_path: a Hugging Face checkpoint")


def _check_export_source(r: Recipe) -> None:
    """train.export_hf writes the config and tokenizer of the student's Hugging Face source (check_export: the
    directory)."""
    out = r.train.export_hf
    _need(not out or bool(r.model.hf_path), f"train.export_hf={out}: the student did not start from a Hugging Face "
          "checkpoint (model.hf_path is null), so there is no config or tokenizer to export with; set "
          "model.hf_path, or run `megatron-kd export --hf-path DIR` after training")


def quant_problem(fmt: str, cuda: bool, key: str = "quant.format") -> str | None:
    """Why the student cannot be quantized as `fmt` here (one sentence naming `key`), or None."""
    unknown = quant_formats.unknown_problem(fmt, key)
    if unknown:
        return unknown
    if fmt == "none":
        return None
    if quant_formats.get(fmt).cuda_only and not cuda:
        runs = ", ".join(n for n, f in quant_formats.FORMATS.items() if not f.cuda_only and n != "none")
        return (f"{key}={fmt} needs a CUDA GPU (ModelOpt fake-quantizes {fmt} on CUDA tensors only); on this "
                f"machine use one of {runs}")
    from ..runtime.extras import missing
    return missing("quant", "fake-quantized students", f"{key}={fmt}")


def _check_kd(r: Recipe, skipped: list | None = None, later=()) -> None:
    """The kd section: mode, K, the teacher or cache it needs, the loss keys."""
    kd, p = r.kd, r.parallel
    src = TargetSource.of(kd)
    _need(src.known, f"kd.mode={kd.mode!r}: use one of {MODES}")
    # a sampled cache's K is its number of draws (kd.cache_samples): building one needs no kd.top_k
    if src.needs_teacher and not (src.builds_cache and kd.cache_encoding == "sampled"):
        _need(kd.top_k is not None, f"kd.top_k=null takes a cache's K; kd.mode={kd.mode}"
              f"{' with kd.build_cache=true' if src.builds_cache else ''} computes the teacher's top-K itself: "
              "set kd.top_k (e.g. 100)")
    if src.distills and kd.top_k is not None:
        _need(top_k_fits(kd.top_k), f"kd.top_k={kd.top_k} must be >= 1")
    if src.needs_teacher:
        check_model(r.teacher, "teacher", p.tp, skipped)
    _need(not src.builds_cache or p.pp == 1, f"kd.build_cache=true runs the teacher with parallel.pp=1 (here "
          f"parallel.pp={p.pp}); build the cache separately (`megatron-kd cache build`) for a pipelined teacher, "
          "then train with kd.build_cache=false")
    _check_cache_encoding(kd)
    if src.reads_cache and not (not kd.cache and "kd.cache" in later):
        _need(bool(kd.cache), "kd.cache is required in offline mode: the teacher top-K cache directory "
              "(build one with `megatron-kd cache build`, or set kd.build_cache=true)")
        _need(_there(skipped, f"kd.cache={kd.cache} (read there)") or not os.path.isfile(kd.cache), f"kd.cache={kd.cache} is a file, not a cache directory; point kd.cache "
              "at a directory (kd.build_cache=true makes it)")
    if src.teacher_each_step:  # the teacher computes its targets at kd.temperature every step
        _need(kd.cache_temperature is None, f"kd.cache_temperature={kd.cache_temperature} re-tempers a cache "
              "captured at that temperature, but kd.mode=online computes the teacher at kd.temperature each step; "
              "set kd.cache_temperature=null")
    try:
        kd.loss_options()
    except ValueError as e:  # the option's own name leads the message: give it its recipe key
        key = str(e).split("=", 1)[0]
        raise RecipeError(f"kd.{e}" if key.isidentifier() and hasattr(kd, key) else f"kd: {e}") from None
    if src.distills:
        _need(kd.kl_weight > 0 or kd.ce_weight > 0, f"kd.kl_weight={kd.kl_weight} and kd.ce_weight={kd.ce_weight} "
              "leave no loss to train on; set kd.kl_weight (e.g. 1) or kd.ce_weight > 0")


def _check_cache_encoding(kd) -> None:
    """kd.cache_encoding / cache_top_p / cache_min_k: what a cache build would be asked for."""
    from ..cache.encoding import ENCODINGS, EncodingOptions
    from ..cache.topp import check_top_p
    _need(kd.cache_encoding in ENCODINGS, f"kd.cache_encoding={kd.cache_encoding!r}: use one of {ENCODINGS}")
    options = EncodingOptions.from_recipe(kd)
    mismatch = options.problem()
    _need(mismatch != "needs_top_p", "kd.cache_encoding=topp keeps per position the fewest ids holding a mass P: "
          "set kd.cache_top_p (e.g. 0.999)")
    _need(mismatch != "fixed_k", f"kd.cache_top_p / kd.cache_min_k need kd.cache_encoding=topp (kd.cache_encoding="
          f"{kd.cache_encoding} stores K ids at every position); set kd.cache_encoding=topp or drop them")
    _need(mismatch != "needs_samples", "kd.cache_encoding=sampled stores N draws per position: set "
          "kd.cache_samples (e.g. 16)")
    _need(mismatch != "not_sampled", f"kd.cache_samples / kd.cache_sample_seed need kd.cache_encoding=sampled "
          f"(kd.cache_encoding={kd.cache_encoding} stores the teacher's top ids); set kd.cache_encoding=sampled or "
          "drop them")
    if kd.cache_encoding == "sampled":
        from ..parallel.sample import check_draws
        problem = check_draws(kd.cache_samples)
        _need(problem is None, f"kd.cache_{problem}" if problem else "")
        _need(kd.top_k in (None, options.forced_top_k()), f"kd.top_k={kd.top_k}: a "
              f"sampled cache holds the distinct ids of its kd.cache_samples={kd.cache_samples} draws, all of them "
              f"read: set kd.top_k=null or {kd.cache_samples}")
    if kd.cache_encoding == "topp":
        problem = check_top_p(kd.cache_top_p, 1 if kd.cache_min_k is None else kd.cache_min_k,
                              kd.top_k if kd.top_k is not None else 1 << 30)
        _need(problem is None, f"kd.cache_{problem}" if problem else "")


def _check_data(r: Recipe, later=()) -> None:
    d, p = r.data, r.parallel
    _need(d.kind in ("mock", "indexed"), f"data.kind={d.kind!r}: use mock or indexed")
    if d.kind == "indexed" and not (not d.path and "data.path" in later):
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


def _check_train(r: Recipe) -> None:
    t, p = r.train, r.parallel
    _need(t.iters >= 1, f"train.iters={t.iters} must be >= 1")
    _need(t.save is None or str(t.save).strip() != "", "train.save is empty; give the run's directory, or leave "
          "train.save out (the run directory runs/<recipe>)")
    check_train(t)  # the numbers and policies Megatron would take and fail on later
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
    if t.stop_at is not None:
        _need(1 <= t.stop_at <= t.iters, f"train.stop_at={t.stop_at} must be in [1, train.iters={t.iters}]")


def _check_fused(r: Recipe, cuda: bool) -> None:
    if r.kd.impl == "fused":
        problem = fused_unavailable(cuda)
        _need(not problem, f"kd.impl=fused {problem}; use kd.impl=auto (fused where it runs, else chunked)")


def _check_cpu(r: Recipe) -> None:
    """What only GPUs run."""
    t, p = r.train, r.parallel
    _need(p.pp == 1, f"parallel.pp={p.pp}: pipeline parallel needs GPUs (Megatron's schedules are CUDA-only); "
          "use parallel.pp=1 on CPU")
    _need(p.cp == 1, f"parallel.cp={p.cp}: context parallel attention needs Transformer Engine on GPUs; "
          "use parallel.cp=1 on CPU")
    _need(not p.sequence_parallel, "parallel.sequence_parallel=true needs GPUs (Megatron's norms refuse it "
          "without TE/apex); set it false on CPU")
    _need(t.precision == "fp32" or t.optimizer == "lean_adam", f"train.precision={t.precision} needs GPUs "
          "(Megatron's mixed-precision optimizer is CUDA-only); use train.precision=fp32 on CPU, or "
          "train.precision=bf16 with train.optimizer=lean_adam")


def check_recompute(m: ModelConfig, section: str) -> None:
    """Activation recompute as megatron-core's TransformerConfig takes it (it raises in the model build otherwise)."""
    g, method, n = m.recompute_granularity, m.recompute_method, m.recompute_num_layers
    _need(g in (None, "full", "selective"), f"{section}.recompute_granularity={g!r}: use null, full or selective")
    _need(method in (None, "uniform", "block"), f"{section}.recompute_method={method!r}: use uniform or block")
    if g == "full":
        _need(method is not None, f"{section}.recompute_granularity=full needs {section}.recompute_method: uniform "
              "(every layer, in groups of recompute_num_layers) or block (the first recompute_num_layers of each "
              "stage)")
        _need(isinstance(n, int) and n >= 1, f"{section}.recompute_granularity=full needs "
              f"{section}.recompute_num_layers >= 1 (got {n}): the layers per group (uniform) or per stage (block)")
    elif g == "selective":
        _need(n is None, f"{section}.recompute_num_layers={n} applies to recompute_granularity=full only; set "
              f"{section}.recompute_num_layers=null with selective recompute")


ROPE_SCALING_KEYS = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                     "rope_original_max_position_embeddings")


def check_rope_scaling(m, section: str) -> None:
    """Llama 3 RoPE scaling: only on rope, with the values Hugging Face's llama3 formula can use; a scaling key
    changed while scaling is off would change nothing, so it is refused rather than ignored."""
    if not m.rope_scaling:
        defaults = {f.name: f.default for f in fields(ModelConfig)}
        changed = [k for k in ROPE_SCALING_KEYS if getattr(m, k) != defaults[k]]
        # A preset (recipes/model/llama3*.yaml) may set the key, so the fix names Hydra's deletion override.
        key = f"{section}.{changed[0]}" if changed else ""
        _need(not changed, f"{key}={getattr(m, changed[0]) if changed else ''} "
              f"has no effect with {section}.rope_scaling=false; set {section}.rope_scaling=true (Llama 3 "
              f"RoPE scaling) or remove the key (override '~{key}')")
        return
    _need(m.position_embedding_type == "rope", f"{section}.rope_scaling=true scales RoPE frequencies, but "
          f"{section}.position_embedding_type={m.position_embedding_type!r}; set it to rope or rope_scaling=false")
    _need(m.rope_scaling_factor >= 1, f"{section}.rope_scaling_factor={m.rope_scaling_factor} must be >= 1 "
          "(Llama-3.1: 8, Llama-3.2: 32)")
    _need(0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
          f"{section}.rope_low_freq_factor={m.rope_low_freq_factor} and {section}.rope_high_freq_factor="
          f"{m.rope_high_freq_factor} need 0 < low < high (Llama 3: 1 and 4)")
    o = m.rope_original_max_position_embeddings
    _need(isinstance(o, int) and o >= 1, f"{section}.rope_original_max_position_embeddings={o!r} must be a "
          "positive integer (Llama 3: 8192)")


def check_run(r: Recipe, world_size: int, cuda: bool, vocab_size: int) -> None:
    """What needs the tokenizer's size, this machine and the world size (after check_recipe; no process group
    or model yet)."""
    check_vocab(vocab_size, r.model, "model", r.parallel.tp)
    src = TargetSource.of(r.kd)
    if src.needs_teacher:
        check_vocab(vocab_size, r.teacher, "teacher", r.parallel.tp)
    p = r.parallel
    if cuda and p.cp > 1 and not features.te_available():
        raise RecipeError(f"parallel.cp={p.cp} needs Transformer Engine attention, which does not import here; use "
                          "parallel.cp=1 or a container with TE")
    for section, m in [("model", r.model), *([("teacher", r.teacher)] if src.needs_teacher else [])]:
        check_sequence_parallel(m, section, p, cuda)
    check_top_k_vocab(r, vocab_size)
    check_world(r, world_size)
    check_export(r)


def check_top_k_vocab(r: Recipe, vocab_size: int) -> None:
    """kd.top_k against the tokenizer's vocabulary (check_run; `megatron-kd plan` once it read the vocabulary)."""
    if TargetSource.of(r.kd).distills and r.kd.top_k is not None and not top_k_fits(r.kd.top_k, vocab_size):
        raise RecipeError(f"kd.top_k={r.kd.top_k} exceeds the vocabulary ({vocab_size} ids)")


def check_sequence_parallel(m: ModelConfig, section: str, p, cuda: bool) -> None:
    """parallel.sequence_parallel against the norms of the spec `m` is built on here (a run's models, or the
    teacher of `megatron-kd cache build --recipe`). p: the recipe's parallel section."""
    if cuda and p.sequence_parallel and p.tp > 1:
        why = _sequence_parallel_norms_refusal(m, section, p.tp)
        _need(why is None, why)


def _sequence_parallel_norms_refusal(m: ModelConfig, section: str, tp: int) -> str | None:
    """Why the norms of the layer spec `m` is built on here refuse parallel.sequence_parallel (None: they take it).
    Transformer Engine's spec has TE's norms, which take it. The SDPA and local specs are megatron-core's local spec,
    whose norms are its torch norms (they assert sequence_parallel is off) except a LayerNorm where apex imports
    (apex's fused LayerNorm); an RMSNorm is a torch norm there with or without apex. So it is the spec built, not
    whether TE imports, that decides: attention_backend=sdpa where TE imports still gets torch norms."""
    try:
        backend = features.spec_backend(m)
    except RuntimeError:  # attention_backend=te without TE: check_model refuses that, naming the key
        return None
    if backend == "te" or (m.normalization == "LayerNorm" and features.apex_available()):
        return None
    how = f"{section}.attention_backend={m.attention_backend}"
    if m.attention_backend == "auto":
        how += " (Transformer Engine does not import here)"
    if features.te_available():
        fix = f"set {section}.attention_backend=te (or auto: Transformer Engine imports here)"
    else:
        fix = "run where Transformer Engine imports (a NeMo or Megatron-Bridge container) with " \
              f"{section}.attention_backend=auto"
        if m.normalization == "LayerNorm":
            fix += " or where NVIDIA apex imports"
    return (f"parallel.sequence_parallel=true with parallel.tp={tp}: {how} builds {section}'s {m.normalization} layers "
            f"as megatron-core's torch norms, which refuse sequence parallel; {fix}, or set "
            "parallel.sequence_parallel=false")


def check_export(r: Recipe) -> None:
    """train.export_hf: a student from model.hf_path, and a directory that holds nothing yet."""
    out = r.train.export_hf
    if not out:
        return
    _check_export_source(r)
    if dist.is_initialized() and dist.get_world_size() > 1:  # a caller's multi-rank group would outlive run()
        raise RecipeError(f"train.export_hf={out}: this run joins a process group made outside megatron-kd train, "
                          "which stays up after it (the export runs as one process on rank 0); leave "
                          "train.export_hf unset and run `megatron-kd export --checkpoint SAVE --out DIR` after")
    try:
        check_target(out, r.model.hf_path, "train.export_hf=", "the export never replaces a directory; choose "
                     "another train.export_hf or remove it", keep={"the run's train.save": r.train.save})
    except ValueError as e:
        raise RecipeError(str(e)) from None


def check_target(out: str, src: str, key: str, fix: str | None, keep: dict | None = None) -> bool:
    """An export's target directory: never the student's source checkpoint, nor any of `keep` ({what it is: path}:
    the checkpoint exported, its run's save dir), nor a directory holding one of them or lying inside one (checked first:
    --overwrite must not delete them, and an export must not mix its files into them), never a file, and, when
    `fix` is given, holding nothing yet (else the error names `fix`). True when it holds files. key: how the
    errors name it ("--out ", "train.export_hf=")."""
    for what, path in [("the student's source checkpoint", src), *(keep or {}).items()]:
        if not path:
            continue
        if _inside(path, out) or _inside(out, path):
            where = ("is" if os.path.realpath(out) == os.path.realpath(path)
                     else "holds" if _inside(path, out) else "lies inside")
            raise ValueError(f"{key}{out} {where} {what} {path}; write the export to a directory of its own, "
                             "outside it")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{key}{out} is a file, not a directory; give a directory for the Hugging Face checkpoint")
    full = os.path.isdir(out) and bool(os.listdir(out))
    if full and fix:
        raise ValueError(f"{key}{out} exists and is not empty; {fix}")
    return full


def checked_recipe(cfg):
    """The Recipe of a composed config; what keeps it from running on this machine is said in one line, every
    problem at once: the values the recipe leaves `???` (the schema merge would quietly fill them with defaults),
    a key of the wrong type, train.device=cuda without a GPU."""
    from ..runtime.dist import use_cuda
    from .compose import missing_keys
    from .schema import to_recipe
    problems, recipe = [], None
    missing = missing_keys(cfg)
    if missing:
        problems.append(f"{' and '.join(missing)} {'has' if len(missing) == 1 else 'have'} no value (the recipe "
                        f"leaves {'it' if len(missing) == 1 else 'them'} `???`): pass "
                        f"{' '.join(k + '=...' for k in missing)}")
    try:
        recipe = to_recipe(cfg)
    except RecipeError as e:
        problems.append(str(e))
    if recipe is not None:
        try:
            use_cuda(recipe.train.device)
        except RuntimeError as e:
            problems.append(str(e))
    if problems:
        raise RecipeError("; ".join(problems))
    return recipe


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


NONFINITE_POLICIES = ("stop", "skip")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_train(t) -> None:
    """Numbers of the train section that Megatron would otherwise take and fail on later (or train wrongly with)."""
    _need(_number(t.lr) and t.lr >= 0, f"train.lr={t.lr} must be a number >= 0 (e.g. train.lr=1e-3)")
    _need(_number(t.min_lr) and 0 <= t.min_lr <= t.lr,
          f"train.min_lr={t.min_lr} must be in [0, train.lr={t.lr}] (the schedule decays from lr down to min_lr); "
          "lower train.min_lr or raise train.lr")
    _need(t.global_batch_size >= 1, f"train.global_batch_size={t.global_batch_size} must be >= 1 (a multiple of "
          "train.micro_batch_size x data-parallel size)")
    _need(t.log_interval >= 1, f"train.log_interval={t.log_interval} must be >= 1 (iterations between log lines)")
    _need(t.lr_decay_style in LR_DECAY_STYLES,
          f"train.lr_decay_style={t.lr_decay_style!r}: use one of {', '.join(LR_DECAY_STYLES)}")
    _need(t.lr_warmup_iters >= 0, f"train.lr_warmup_iters={t.lr_warmup_iters} must be >= 0")
    _need(t.lr_decay_iters is None or t.lr_decay_iters >= 1,
          f"train.lr_decay_iters={t.lr_decay_iters} must be >= 1, or null (= train.iters)")
    for k in ("adam_beta1", "adam_beta2"):
        v = getattr(t, k)
        _need(_number(v) and 0 <= v < 1, f"train.{k}={v} must be in [0, 1) (Adam's moment decay; e.g. 0.9 / 0.95)")
    _need(_number(t.adam_eps) and t.adam_eps > 0, f"train.adam_eps={t.adam_eps} must be > 0 (e.g. 1e-8)")
    _need(_number(t.weight_decay) and t.weight_decay >= 0, f"train.weight_decay={t.weight_decay} must be >= 0")
    _need(_number(t.clip_grad) and t.clip_grad >= 0, f"train.clip_grad={t.clip_grad} must be >= 0 (0: no clipping)")
    _need(isinstance(t.save_at_end, bool), f"train.save_at_end={t.save_at_end!r} must be true or false")
    _need(t.save_at_end or not (t.export_hf or t.stop_at), "train.save_at_end=false leaves no checkpoint for "
          "train.export_hf / train.stop_at to use; drop one of them")
    for k in ("save_interval", "eval_interval"):
        v = getattr(t, k)
        _need(v is None or v >= 1, f"train.{k}={v} must be >= 1, or null (only at the end)")
    _need(t.eval_iters >= 0, f"train.eval_iters={t.eval_iters} must be >= 0")
    _need(t.nonfinite in NONFINITE_POLICIES, f"train.nonfinite={t.nonfinite!r}: use stop (end the run at the first "
          "NaN/inf loss or gradient) or skip (skip that update and say so)")
    _need(isinstance(t.resume_changes, (list, tuple)) and all(isinstance(k, str) for k in t.resume_changes),
          f"train.resume_changes={t.resume_changes!r} must be a list of recipe keys, e.g. [train.lr, kd.top_k]")
    unknown = [k for k in t.resume_changes if k not in resume_keys_all()]
    _need(not unknown, f"train.resume_changes names {', '.join(unknown)}, which resuming does not compare; it takes "
          f"any of: {', '.join(resume_keys_all())}")


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


# what a finished cache records -> the recipe key that sets it (messages name the key a user can change); tail,
# divergence and train_temperature: the loss keys a sampled cache's checks name
CACHE_FIELD_KEYS = {
    "top_k": "kd.top_k",
    "encoding": "kd.cache_encoding",
    "samples": "kd.cache_samples",
    "temperature": "kd.temperature",
    "seq_length": "data.seq_length",
    "num_samples": "train.iters x train.global_batch_size",
    "vocab_size": "data.tokenizer / data.vocab_size",
    "tail": "kd.tail",
    "divergence": "kd.divergence",
    "train_temperature": "kd.cache_temperature",
}

# what a cache build records -> (the recipe key that sets it, its value in a recipe)
CACHE_BUILD_KEYS = {field: (CACHE_FIELD_KEYS[field], value) for field, value in {
    "top_k": lambda r: r.kd.top_k,
    "encoding": lambda r: r.kd.cache_encoding,
    "samples": lambda r: r.kd.cache_samples,
    "temperature": lambda r: float(r.kd.capture_temperature),
    "seq_length": lambda r: r.data.seq_length,
    "num_samples": lambda r: r.train.iters * r.train.global_batch_size,
}.items()}


def _same_build_value(field: str, cached, wanted) -> bool:
    """A cache field equals a recipe's value; temperatures by the one temperature equality (the reader's)."""
    if field == "temperature" and cached is not None and wanted is not None:
        return same_temperature(cached, wanted)
    return cached == wanted


def check_sweep_run(r: Recipe) -> None:
    """A run of a sweep (Hydra multirun) reads the sweep's one teacher cache and never builds another: refused when
    kd.cache lies in the run's own directory (each run would build its own, one teacher pass each), or when
    kd.build_cache=true meets the finished cache built with other settings (this run would rebuild it)."""
    kd, src = r.kd, TargetSource.of(r.kd)
    if not src.reads_cache or not kd.cache:
        return
    if _inside(kd.cache, r.train.save):
        raise RecipeError(f"kd.cache={kd.cache} lies in this sweep run's own directory (train.save={r.train.save}), "
                          "so every run of the sweep would build its own cache, one teacher pass each; give the "
                          "sweep one cache outside its runs, e.g. kd.cache=runs/NAME_cache")
    from ..cache.format import is_finished
    if not (src.builds_cache and is_finished(kd.cache)):
        return
    from ..cache.reader import load_manifest
    from ..cache import CacheError
    try:
        m = load_manifest(kd.cache)
    except CacheError:
        return  # the cache checks report it, naming the fix
    diff = [(key, m.get(field), get(r)) for field, (key, get) in CACHE_BUILD_KEYS.items()
            if not _same_build_value(field, m.get(field), get(r))]
    if diff:
        what = ", ".join(f"{key}={b} (the cache: {a})" for key, a, b in diff)
        raise RecipeError(f"kd.cache={kd.cache} is the sweep's finished cache and this run asks kd.build_cache=true "
                          f"with {what}, which would rebuild it; set kd.build_cache=false to read it as it is (any "
                          f"kd.top_k up to its {m.get('top_k')}, up to its {m.get('num_samples')} samples), or give "
                          "these values their own kd.cache")


def yaml_file_problem(path: str) -> str | None:
    """Why the YAML file `path` cannot be read (None: it parses)."""
    import yaml
    try:
        text = open(path, "rb").read().decode("utf-8")
    except UnicodeDecodeError as e:
        return f"recipe file {path} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}: binary " \
               "content?); restore it from version control or remove it"
    except OSError as e:
        return f"recipe file {path} cannot be read ({e.strerror or e})"
    if "\x00" in text:
        return f"recipe file {path} holds NUL bytes (binary content?); restore it from version control or remove it"
    try:
        yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        return f"recipe file {path}: YAML syntax error{where} ({what}); fix that line"
    return None


def recipe_file_error(name: str, config_path, overrides: list, recipes_dir) -> str | None:
    """When the recipe does not compose, the first recipe file (the named one, then every YAML file of its
    directories) that is not valid YAML, as one sentence; None when composing works or fails for another reason
    (Hydra reports those itself)."""
    from pathlib import Path
    from .compose import compose, config_dir, recipe_target
    try:
        compose(recipe_target(name, config_path), overrides)
        return None
    except Exception:  # noqa: BLE001  the reason is looked for below; Hydra reports any other one
        pass
    try:
        roots = [config_dir(config_path)] if config_path else []
    except RecipeError:
        return None
    roots.append(Path(recipes_dir))
    first = [r / f"{name}.yaml" for r in roots]
    files = [p for p in first if p.is_file()]
    files += sorted(p for r in roots if r.is_dir() for p in r.rglob("*.y*ml") if p not in files)
    for p in files:
        problem = yaml_file_problem(str(p))
        if problem:
            return problem
    return None
