"""Run a Bridge recipe with offline KD from a Bridge-style YAML override file that has a `kd:` section.

    torchrun --nproc-per-node 8 -m megatron_kd.bridge.run --recipe llama32_3b_pretrain_config \
        --config-file recipes/bridge/llama32_3b_offline_kd.yaml [overrides: train.train_iters=100 kd.top_k=100]

Everything but `kd` is merged onto the recipe's ConfigContainer the way Bridge's own example scripts do
(OmegaConf merge, then Hydra-syntax overrides); `kd` becomes an OfflineKDConfig.
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


def build(argv=None):
    """(ConfigContainer with overrides applied and KD enabled, forward step)."""
    p = argparse.ArgumentParser(prog="python -m megatron_kd.bridge.run", description=__doc__.split("\n")[0])
    p.add_argument("--recipe", required=True, help="Bridge recipe function, e.g. llama32_3b_pretrain_config")
    p.add_argument("--config-file", default=None, help="Bridge-style override YAML with a kd: section")
    p.add_argument("overrides", nargs="*", help="Hydra-syntax overrides; kd.* go to the kd section")
    a = p.parse_args(argv)

    kd_overrides, bridge_overrides = split_kd_overrides(a.overrides)
    bridge_yaml, kd_yaml = read_config_file(a.config_file)
    kd = apply_kd_overrides(OfflineKDConfig.from_dict(kd_yaml), kd_overrides).validate()

    from omegaconf import OmegaConf
    from megatron.bridge.training.utils.omegaconf_utils import (apply_overrides, create_omegaconf_dict_config,
                                                                  parse_hydra_overrides)

    from .api import enable_offline_kd

    cfg = load_recipe(a.recipe)
    merged, excluded = create_omegaconf_dict_config(cfg)
    merged = OmegaConf.merge(merged, OmegaConf.create(bridge_yaml))
    if bridge_overrides:
        merged = parse_hydra_overrides(merged, bridge_overrides)
    apply_overrides(cfg, OmegaConf.to_container(merged, resolve=True), excluded)
    return cfg, enable_offline_kd(cfg, kd)


def main(argv=None) -> int:
    cfg, forward_step = build(argv)
    from megatron.bridge.training.pretrain import pretrain

    pretrain(cfg, forward_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
