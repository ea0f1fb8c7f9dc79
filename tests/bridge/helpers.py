"""Shared pieces of the real-Bridge tests: a tiny config, a deterministic teacher (a module:function factory the
cache command can load), Bridge's own setup lines run verbatim."""
import inspect
import textwrap

import torch

SEQ, VOCAB, GBS, MBS, ITERS, K = 32, 256, 4, 2, 3, 8


def tiny_cfg(seq=SEQ, vocab=VOCAB, iters=ITERS, gbs=GBS, mbs=MBS, seed=1234):
    from megatron_kd.bridge.recipes import tiny_local_config
    cfg = tiny_local_config(seq_length=seq, vocab_size=vocab)
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = iters, gbs, mbs
    cfg.dataset.random_seed = seed
    return cfg


def table_teacher(vocab: int = VOCAB, seed: int = 0):
    """logits = table[token]: a teacher whose top-K depends on the token, so a shifted sample shows."""
    from megatron_kd.teacher.protocol import CallableTeacher
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed))
    return CallableTeacher(lambda tokens: table[tokens], vocab, identity={"name": "table", "seed": seed})


def bridge_setup_dataset_lines():
    """The statements of Bridge's setup() that touch cfg.dataset once the tokenizer exists (training/setup.py:
    from `if hasattr(cfg.dataset, "tokenizer")` to before `if cfg.train.num_epochs`), as source to exec."""
    from megatron.bridge.training import setup as bridge_setup
    src = inspect.getsource(bridge_setup.setup)
    start = src.index('    if hasattr(cfg.dataset, "tokenizer"):')
    stop = src.index("    if cfg.train.num_epochs is not None:", start)
    return textwrap.dedent(src[start:stop])


def run_bridge_setup_lines(cfg, tokenizer):
    exec(compile(bridge_setup_dataset_lines(), "bridge/training/setup.py", "exec"),
         {"cfg": cfg, "tokenizer": tokenizer})


def bridge_build(cfg):
    """Bridge's pretrain data path on CPU, minus the CUDA flag broadcast: runtime_config_update, the tokenizer,
    setup's dataset lines, get_dataset_provider + its context binding, build_train_valid_test_datasets."""
    from megatron.bridge.data.loaders import build_train_valid_test_datasets
    from megatron.bridge.data.utils import get_dataset_provider
    from megatron.bridge.training import setup as bridge_setup
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer
    runtime_config_update(cfg)
    tokenizer = build_tokenizer(cfg.tokenizer)
    run_bridge_setup_lines(cfg, tokenizer)
    provider = bridge_setup._bind_dataset_provider_context(get_dataset_provider(cfg.dataset), tokenizer=tokenizer,
                                                           pg_collection=None)
    return build_train_valid_test_datasets(cfg, provider), tokenizer
