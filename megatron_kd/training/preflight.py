"""The preflight of a training run: every check that needs neither a process group nor a model, before any
work. The recipe's own checks (recipe/checks.py: the sections alone and across each other, then what needs the
tokenizer's size and the world size), then the inputs: the corpus (long enough, tokenized with data.tokenizer) and
the checkpoints loaded as weights only (of the recipe's architecture).
"""
import os

from ..data.datasets import load_tokenizer
from ..errors import RecipeError
from ..recipe.checks import check_recipe, check_run
from ..recipe.hf import resolve_hf
from ..recipe.targets import TargetSource
from .resume import check_checkpoint_model


def preflight(r, world_size: int, cuda: bool):
    """Checks that need neither a process group nor a model; returns the tokenizer."""
    resolve_hf(r)
    check_recipe(r, None, cuda)
    tok = load_tokenizer(r.data)
    check_run(r, world_size, cuda, tok.vocab_size)
    check_inputs(r, tok)
    return tok


def _prefixes(path) -> list:
    paths = [path] if isinstance(path, str) else [str(x) for x in path]
    if len(paths) > 1:
        try:
            float(paths[0])
            return paths[1::2]
        except ValueError:
            pass
    return paths


def check_corpus(d, tok) -> None:
    """Indexed data: tokenized with this run's tokenizer (the .json sidecar `megatron-kd data prepare` writes
    records its hash), and at least one sample of data.seq_length + 1 tokens long (else Megatron's index repeats
    the corpus without end building one sample)."""
    if d.kind != "indexed" or not d.path:
        return
    import json
    total = 0
    for p in _prefixes(d.path):
        side = p + ".json"
        meta = {}
        if os.path.isfile(side):
            try:
                meta = json.load(open(side))
            except ValueError:
                meta = {}
        want = getattr(tok, "sha", None)
        got = meta.get("tokenizer_sha256")
        if got and want and want != "mock" and got != want:
            raise RecipeError(f"data.path={p} was tokenized with another tokenizer ({meta.get('tokenizer')}, sha256 "
                              f"{got}) than data.tokenizer={d.tokenizer} (sha256 {want}); set data.tokenizer to the "
                              "one the data was prepared with, or prepare the data again with this tokenizer")
        if isinstance(meta.get("tokens"), int):
            total += meta["tokens"]
        else:
            from megatron.core.datasets.indexed_dataset import IndexedDataset
            ds = IndexedDataset(p, mmap=True)  # held while its memory-mapped lengths are read
            total += int(ds.sequence_lengths.sum())
            del ds
    if d.seq_length + 1 > total:
        raise RecipeError(f"data.seq_length={d.seq_length} is longer than the whole corpus ({total} tokens in "
                          f"data.path); lower data.seq_length below {total} or add data")


def check_inputs(r, tok) -> None:
    """preflight: the corpus, and the checkpoints loaded as weights only, before any model is built."""
    check_corpus(r.data, tok)
    if TargetSource.of(r.kd).teacher_each_step and r.teacher.load and not r.teacher.hf_path:
        check_checkpoint_model(r.teacher.load, r.teacher, "teacher.load", "teacher")
    if r.train.pretrained and not r.model.hf_path:
        check_checkpoint_model(r.train.pretrained, r.model, "train.pretrained", "model")

