"""A teacher top-K cache over exactly the samples a Bridge recipe trains on: cache row i is Bridge's sample i.

    python -m megatron_kd.bridge.cache build --recipe llama32_3b_pretrain_config \
        --config-file recipes/bridge/llama32_3b_offline_kd.yaml --teacher hf:/models/Llama-3.1-8B [overrides]

The recipe, the YAML and the overrides are merged as `megatron_kd.bridge.run` merges them; then Bridge's own
pieces make the samples: its tokenizer (build_tokenizer), its sample counts (get_train_valid_test_num_samples:
train_iters x global_batch_size), its dataset provider for cfg.dataset (same blend, split, seed, sequence
length), and the first train_samples of the train split are what the teacher sees. The cache goes to kd.cache
(or --out) with kd.top_k (default 100) and kd.temperature, so `megatron_kd.bridge.run` with the same file trains
on it. A restart of the same command resumes an unfinished cache; under torchrun, data-parallel ranks split it.

Teachers (read by megatron_kd.teacher.spec, as `megatron-kd cache build` reads them): `hf:DIR` (a local
transformers checkpoint, HFTeacher, one GPU per rank), `mkd:SAVE_DIR` (a `megatron-kd train` checkpoint: its
recipe's model section and weights; --teacher-args {"tp": 2, "precision": "bf16"}) or `module:function`
returning a teacher (megatron_kd.teacher: MegatronTeacher, CallableTeacher, ...), called with --teacher-args.
"""
import argparse
import json
import sys

from ..rules import DEFAULT_TOP_K
from .run import add_config_args, load_config

SETUP_FIELDS = ("tokenizer", "token_dtype_code")


def attach_tokenizer(dataset_cfg, tokenizer) -> None:
    """What Bridge's setup does to cfg.dataset once the tokenizer exists (training/setup.py, after
    build_tokenizer): the dataset config gets the tokenizer and, when it has the field, token_dtype_code."""
    if hasattr(dataset_cfg, "tokenizer"):
        dataset_cfg.tokenizer = tokenizer
    if hasattr(dataset_cfg, "token_dtype_code") and dataset_cfg.token_dtype_code is None:
        vocab = getattr(tokenizer, "vocab_size", None)
        if vocab is not None:
            import numpy
            dataset_cfg.token_dtype_code = 4 if vocab > numpy.iinfo(numpy.uint16).max + 1 else 8


def bridge_train_samples(cfg):
    """(the train samples Bridge's run of cfg consumes, in its order, as a dataset; the tokenizer).
    cfg must be the run's config before enable_offline_kd (its own dataset config)."""
    from megatron.bridge.data.loaders import get_train_valid_test_num_samples
    from megatron.bridge.data.utils import get_dataset_provider
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    from .data import bind_provider, train_head
    runtime_config_update(cfg)  # finalizes the dataset config (blend, split) as pretrain() does
    tokenizer = build_tokenizer(cfg.tokenizer)
    attach_tokenizer(cfg.dataset, tokenizer)
    counts = list(get_train_valid_test_num_samples(cfg))
    provider = bind_provider(get_dataset_provider(cfg.dataset), tokenizer, None)
    train, _, _ = provider(counts, cfg.dataset)
    if train is None:
        raise ValueError("the recipe's dataset config builds no train split (dataset.split gives it nothing)")
    return train_head(train, counts[0]), tokenizer


def build(a) -> dict:
    import torch
    from ..cache.encoding import EncodingOptions
    from ..runtime.dist import init_process_group
    from ..teacher.build import build_cache
    from ..teacher.spec import make_teacher
    cfg, kd, notes = load_config(a)
    out = a.out or kd.cache
    if not out:
        raise ValueError("no cache directory: set kd.cache in the --config-file (or kd.cache=...) or --out")
    top_k = a.top_k or kd.top_k or DEFAULT_TOP_K
    init_process_group(torch.cuda.is_available(), launched_only=True)
    train, tokenizer = bridge_train_samples(cfg)
    vocab = int(getattr(tokenizer, "vocab_size", 0) or 0)
    teacher = make_teacher(a.teacher, json.loads(a.teacher_args or "{}"), vocab_size=vocab or None,
                           seq_length=int(cfg.model.seq_length))
    if vocab and int(teacher.vocab_size) < vocab:
        raise ValueError(f"the teacher's vocabulary ({teacher.vocab_size}) is smaller than the recipe tokenizer's "
                         f"({vocab}): teacher and student must share a tokenizer (tokenizer: in the YAML)")
    if vocab and int(teacher.vocab_size) > vocab:
        # an embedding padded past the tokenizer (Qwen: 152,064 rows for 151,665 tokens): the rows past the
        # tokenizer's ids are no token, so they are neither a KD target nor part of the teacher's softmax
        teacher.vocab_size = vocab
    tok_id = str(getattr(cfg.tokenizer, "tokenizer_model", None) or getattr(cfg.tokenizer, "tokenizer_type", ""))
    options = EncodingOptions.from_args(a, top_k)
    options = options.replace(encoding=options.name)
    if options.forced_top_k() is not None:  # a sampled cache holds the ids of its draws: build_cache refuses another
        options = options.replace(top_k=None if a.top_k is None else top_k)
    return build_cache(teacher, train, out, encoding=options, temperature=kd.capture_temperature,
                       num_samples=len(train), micro_batch_size=a.micro_batch_size, chunk_size=kd.chunk_size,
                       tokenizer_id=tok_id, dataset_id=str(getattr(train, "unique_description_hash", "")),
                       overwrite=a.overwrite, progress=not a.no_progress)


def parser() -> argparse.ArgumentParser:
    from ..cache.encoding import add_flags
    p = argparse.ArgumentParser(prog="python -m megatron_kd.bridge.cache", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="run a teacher over the recipe's train samples and write (or resume) a cache")
    add_config_args(b)
    b.add_argument("--teacher", required=True, help="hf:MODEL_DIR, mkd:MEGATRON_KD_SAVE_DIR or module:function "
                   "returning a teacher")
    b.add_argument("--teacher-args", default="{}", help='JSON keyword arguments, e.g. \'{"dtype": "bfloat16"}\'')
    b.add_argument("--out", default=None, help="cache directory (default: kd.cache)")
    b.add_argument("--top-k", type=int, default=None, help=f"default: kd.top_k, else {DEFAULT_TOP_K}")
    add_flags(b)  # --encoding and each encoding's own (cache/encoding/)
    b.add_argument("--micro-batch-size", type=int, default=1)
    b.add_argument("--overwrite", action="store_true", help="delete a cache built with different settings")
    b.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    from ..cache.errors import CacheError
    try:
        m = build(a)
    except (CacheError, ValueError) as e:
        print(f"megatron_kd.bridge.cache: error: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"cache complete: {a.out or 'kd.cache'}: {m['num_samples']} samples (Bridge's train samples "
              f"0..{m['num_samples'] - 1}) x {m['seq_length']} positions x K={m['top_k']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
