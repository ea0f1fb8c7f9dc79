"""Run a Bridge recipe with offline KD from a Bridge-style YAML override file that has a `kd:` section.

    torchrun --nproc-per-node 8 -m megatron_kd.bridge.run --recipe llama32_3b_pretrain_config \
        --config-file recipes/bridge/llama32_3b_offline_kd.yaml [overrides: train.train_iters=100 kd.top_k=100]

Everything but `kd` is merged onto the recipe's ConfigContainer the way Bridge's own example scripts do
(OmegaConf merge, then Hydra-syntax overrides); `kd` becomes an OfflineKDConfig. Where Transformer Engine does
not import, the model is built from megatron-core's local layers with SDPA attention (--layers, recipes.py).
A checkpoint in checkpoint.load resumes the run: Bridge restores its consumed-sample count, and sample i of the
train split keeps cache row i, so the KD targets continue at the right sample.
"""
import argparse
import importlib
import sys

from .config import OfflineKDConfig, apply_kd_overrides, split_kd_overrides


def read_config_file(path: str | None) -> tuple[dict, dict]:
    """(Bridge sections, kd section) of an override YAML."""
    if not path:
        return {}, {}
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of config sections, got {type(data).__name__}")
    kd = data.pop("kd", None) or {}
    return data, kd


def load_recipe(name: str):
    """`llama32_3b_pretrain_config` (from megatron.bridge.recipes) or `package.module:function`."""
    module, _, func = name.rpartition(":") if ":" in name else ("megatron.bridge.recipes", "", name)
    return getattr(importlib.import_module(module), func)()


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, help="Bridge recipe function, e.g. llama32_3b_pretrain_config, or "
                   "module:function (megatron_kd.bridge.recipes:tiny_local_config)")
    p.add_argument("--config-file", default=None, help="Bridge-style override YAML with a kd: section")
    p.add_argument("--layers", choices=["auto", "local", "recipe"], default="auto",
                   help="auto: the recipe's layers when Transformer Engine imports, else megatron-core's local "
                   "layers with SDPA attention; local: always those; recipe: never change them")
    p.add_argument("overrides", nargs="*", help="Hydra-syntax overrides; kd.* go to the kd section")


def load_config(a) -> tuple:
    """(ConfigContainer with the YAML and overrides applied, OfflineKDConfig, notes): no KD wiring yet."""
    kd_overrides, bridge_overrides = split_kd_overrides(a.overrides)
    bridge_yaml, kd_yaml = read_config_file(a.config_file)
    kd = apply_kd_overrides(OfflineKDConfig.from_dict(kd_yaml), kd_overrides)

    from omegaconf import OmegaConf
    from megatron.bridge.training.utils.omegaconf_utils import (apply_overrides, create_omegaconf_dict_config,
                                                                  parse_hydra_overrides)

    from .recipes import have_te, use_local_layers

    cfg = load_recipe(a.recipe)
    merged, excluded = create_omegaconf_dict_config(cfg)
    merged = OmegaConf.merge(merged, OmegaConf.create(bridge_yaml))
    if bridge_overrides:
        merged = parse_hydra_overrides(merged, bridge_overrides)
    apply_overrides(cfg, OmegaConf.to_container(merged, resolve=True), excluded)
    notes = []
    if a.layers == "local" or (a.layers == "auto" and not have_te()):
        changed = use_local_layers(cfg.model)
        if changed:
            notes.append("Transformer Engine is not used here: " + ", ".join(changed))
    return cfg, kd, notes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_kd.bridge.run", description=__doc__.split("\n")[0])
    add_config_args(p)
    p.add_argument("--loss-log", default=None, help="append one JSON line per step (iteration, losses) here")
    return p


def build(argv=None):
    """(ConfigContainer with overrides applied and KD enabled, forward step, parsed args)."""
    a = parser().parse_args(argv)
    cfg, kd, notes = load_config(a)
    from .api import enable_offline_kd
    for n in notes:
        print(f"megatron_kd.bridge.run: note: {n}", flush=True)
    return cfg, enable_offline_kd(cfg, kd.validate()), a


def main(argv=None, callbacks=None) -> int:
    cfg, forward_step, a = build(argv)
    from megatron.bridge.training.pretrain import pretrain

    callbacks = list(callbacks or [])
    if a.loss_log:
        from .callbacks import LossLog
        callbacks.append(LossLog(a.loss_log))
    pretrain(cfg, forward_step, callbacks=callbacks or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
