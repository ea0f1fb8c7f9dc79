"""A recipe's Hugging Face checkpoints: `model.hf_path` (the student starts from it) and `teacher.hf_path`.

`resolve(recipe)` runs before any work: it checks each HF directory (a checkpoint, Bridge installed, an
architecture Bridge maps, a layout it splits into), that teacher, student, data.tokenizer and an existing
kd.cache share one tokenizer, and writes the checkpoint's architecture into the recipe section (so FLOP
counts, plans, checkpoints and resume checks see the real model).
"""
import json
import os

from ..runtime.te_compat import own_attention_cp_refusal, te_attention_refusal
from ..cache.format import MANIFEST, is_finished
from ..cache.hashing import tokenizer_id
from ..hf.checks import (HFCheckpointError, check_hf_dir, check_layout, check_same_tokenizer, hf_vocab_size,
                         tokenizer_size)
from ..hf.model import open_hf
from .fp8 import fp8_fields, fp8_keys
from .schema import Recipe, RecipeError
from .targets import TargetSource


def resolve_hf(r: Recipe, teacher: bool | None = None) -> None:
    """model.hf_path / teacher.hf_path checked and their architecture filled in (megatron_kd/hf)."""
    if r.model.hf_path or r.teacher.hf_path:
        try:
            resolve(r, teacher=teacher)
        except HFCheckpointError as e:
            raise RecipeError(str(e)) from None


def teacher_used(r) -> bool:
    src = TargetSource.of(r.kd)
    return src.needs_teacher or (src.reads_cache and _cache_missing(r.kd.cache))


def _cache_missing(cache) -> bool:
    return bool(cache) and not is_finished(cache)


def sections(r, *, teacher: bool | None = None):
    """(recipe key prefix, section) of the sections that name an HF checkpoint and are used."""
    out = [("model", r.model)] if r.model.hf_path else []
    use_teacher = teacher_used(r) if teacher is None else teacher
    if r.teacher.hf_path and use_teacher:
        out.append(("teacher", r.teacher))
    return out


def resolve(r, *, teacher: bool | None = None) -> list:
    """Check the recipe's HF checkpoints and fill their sections' architecture. Returns the keys resolved."""
    p = r.parallel
    done = []
    for name, m in sections(r, teacher=teacher):
        key = f"{name}.hf_path"
        check_hf_dir(m.hf_path, key)
        if name == "teacher":  # the teacher runs unpipelined beside the student / in the cache builder
            check_layout(m.hf_path, key, tp=p.tp, ep=p.ep, etp=p.etp)
        else:
            check_layout(m.hf_path, key, tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp)
        hf = open_hf(m.hf_path, key)
        f8 = fp8_fields(m)
        if f8 and hf.te_attention_unverified():
            raise HFCheckpointError(f"{key}={m.hf_path!r}: " + te_attention_refusal(fp8_keys(m, name)["fp8"],
                                                                                    f8["fp8"]))
        if p.cp > 1 and hf.te_attention_unverified() and (name == "model" or TargetSource.of(r.kd).teacher_each_step):
            raise HFCheckpointError(f"{key}={m.hf_path!r}: " + own_attention_cp_refusal(name, p.cp))
        arch = hf.architecture()
        for k, v in arch.items():
            setattr(m, k, v)
        if p.etp is None and arch["num_moe_experts"] and arch["add_bias_linear"]:
            p.etp = 1  # Megatron splits MoE layers with biases (GPT-OSS) only with expert TP 1
        done.append(name)
    if r.model.hf_path and r.teacher.hf_path and "teacher" in done:
        check_same_tokenizer(r.teacher.hf_path, "teacher.hf_path", r.model.hf_path, "model.hf_path")
    for name, m in sections(r, teacher=teacher):
        key = f"{name}.hf_path"
        if r.data.tokenizer:
            check_same_tokenizer(m.hf_path, key, r.data.tokenizer, "data.tokenizer")
        elif r.data.vocab_size is not None:  # the tokenizer's ids (an embedding may be padded past them)
            ids = tokenizer_size(m.hf_path) or hf_vocab_size(m.hf_path, key)
            if r.data.vocab_size != ids:
                raise HFCheckpointError(f"data.vocab_size={r.data.vocab_size} but {key}={m.hf_path!r} has "
                                        f"{ids} ids; set data.vocab_size to it (or give data.tokenizer, the "
                                        "checkpoint's tokenizer.json)")
    check_cache_tokenizer(r)
    return done


def check_cache_tokenizer(r) -> None:
    """An existing kd.cache was built on data of the same tokenizer file as data.tokenizer."""
    cache, tok = getattr(r.kd, "cache", None), r.data.tokenizer
    if not (tok and is_finished(cache) and os.path.isfile(tok)):
        return
    with open(os.path.join(cache, MANIFEST)) as f:
        recorded = str(json.load(f).get("tokenizer") or "")
    sha = tokenizer_id(tok)
    if recorded and recorded != sha:
        raise HFCheckpointError(f"kd.cache={cache} was built with another tokenizer (sha {recorded}) than "
                                f"data.tokenizer={tok} (sha {sha}): its ids mean other tokens; use the cache's "
                                "tokenizer, or rebuild the cache (kd.build_cache=true with a new kd.cache)")
