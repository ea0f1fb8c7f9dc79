"""Offline top-K KD for Megatron-Bridge users: add it to an existing Bridge recipe with a few lines.

    from megatron.bridge.recipes.llama import llama32_3b_pretrain_config
    from megatron.bridge.training.pretrain import pretrain
    from megatron_kd.bridge import OfflineKDConfig, enable_offline_kd

    cfg = llama32_3b_pretrain_config()
    pretrain(cfg, enable_offline_kd(cfg, OfflineKDConfig(cache="/data/kd/llama31_8b_top100")))

or from a Bridge-style YAML with a `kd:` section (recipes/bridge/):

    torchrun --nproc-per-node 8 -m megatron_kd.bridge.run --recipe llama32_3b_pretrain_config \
        --config-file recipes/bridge/llama32_3b_offline_kd.yaml kd.top_k=100 train.train_iters=1000

Importing this package never imports Bridge (or megatron-core); that happens when a run starts.
"""
import importlib

from ..hf.checks import bridge_available
from .config import OfflineKDConfig, apply_kd_overrides, split_kd_overrides

_LAZY = {
    "enable_offline_kd": ".api",
    "OfflineKDForwardStep": ".step",
    "kd_loss_func": ".step",
}

__all__ = ["OfflineKDConfig", "apply_kd_overrides", "split_kd_overrides", "bridge_available", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
