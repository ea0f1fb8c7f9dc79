"""Factories that let `megatron-kd cache build` build the cache a recipe trains on:

    megatron-kd cache build --out CACHE --top-k 100 --micro-batch-size 4 \\
        --teacher megatron_kd.teacher.factories:recipe_teacher --teacher-args '{"recipe": "RECIPE"}' \\
        --dataset megatron_kd.teacher.factories:recipe_dataset --dataset-args '{"recipe": "RECIPE"}'

Both take the recipe name (or a .yaml path) and Hydra overrides. The dataset is exactly the run's training
samples (train.iters x train.global_batch_size of data's train split), so its sample indices are the run's.
Under torchrun every rank runs the command; the teacher factory sets up Megatron's parallel groups.
"""
from ..recipe.checks import check_model, check_sequence_parallel, check_vocab
from ..runtime.dist import use_cuda
from ..recipe.schema import to_recipe
from ..data.datasets import build_datasets, load_tokenizer, samples_needed
from ..recipe.compose import compose


def _recipe(recipe: str, overrides):
    return to_recipe(compose(recipe, list(overrides or []), save="unused"))


def recipe_dataset(recipe: str = "tiny_cpu", overrides=None):
    r = _recipe(recipe, overrides)
    tok = load_tokenizer(r.data)
    train_n, valid_n = samples_needed(r.train, r.data)
    train, _ = build_datasets(r.data, tok, train_n, valid_n)
    return train


def recipe_teacher(recipe: str = "tiny_cpu", overrides=None):
    """The recipe's teacher (weights from teacher.load) as a cache-builder teacher, on this rank's TP shard."""
    from .megatron import start_cache_teacher
    r, vocab_size = checked_recipe_teacher(recipe, overrides)
    return start_cache_teacher(r, vocab_size)


def checked_recipe_teacher(recipe: str = "tiny_cpu", overrides=None):
    """(recipe, the teacher's vocabulary size: its tokenizer's) after every check recipe_teacher makes before it
    builds the teacher; `cache build --dry-run` stops here."""
    r = _recipe(recipe, overrides)
    if r.teacher.hf_path:  # checked, architecture from config.json
        from ..recipe.hf import resolve_hf
        resolve_hf(r, teacher=True)
    tok = load_tokenizer(r.data)
    check_model(r.teacher, "teacher", r.parallel.tp)
    check_sequence_parallel(r.teacher, "teacher", r.parallel, use_cuda(r.train.device))
    check_vocab(tok.vocab_size, r.teacher, "teacher", r.parallel.tp)
    if not (r.teacher.load or r.teacher.hf_path):
        raise ValueError(f"recipe {recipe}: teacher.load is not set; point it at the teacher's checkpoint directory "
                         "(or teacher.hf_path at a Hugging Face checkpoint)")
    return r, tok.vocab_size
