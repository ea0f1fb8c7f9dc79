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
import importlib.util
import os
import sys

from .config import OfflineKDConfig, apply_kd_overrides, split_kd_overrides


def read_config_file(path: str | None) -> tuple[dict, dict]:
    """(Bridge sections, kd section) of an override YAML; a file that is not one is refused in one sentence."""
    if not path:
        return {}, {}
    import yaml
    from ..recipe.checks import yaml_file_problem
    if not os.path.isfile(path):
        raise ValueError(f"--config-file {path} does not exist{' (it is a directory)' if os.path.isdir(path) else ''}"
                         "; give the override YAML (e.g. recipes/bridge/tiny_offline_kd.yaml)")
    problem = yaml_file_problem(path)
    if problem:
        raise ValueError(f"--config-file: {problem}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config-file {path}: expected a mapping of config sections, got {type(data).__name__}")
    kd = data.pop("kd", None) or {}
    if not isinstance(kd, dict):
        raise ValueError(f"--config-file {path}: its kd section is a {type(kd).__name__}, not a mapping of kd keys")
    return data, kd


def load_recipe(name: str):
    """`llama32_3b_pretrain_config` (from megatron.bridge.recipes) or `package.module:function`."""
    module, _, func = name.rpartition(":") if ":" in name else ("megatron.bridge.recipes", "", name)
    fix = "give a recipe function of megatron.bridge.recipes (e.g. llama32_3b_pretrain_config) or module:function"
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ValueError(f"--recipe {name}: no module {module} is importable here; {fix}")
    fn = getattr(importlib.import_module(module), func, None)
    if not callable(fn):
        raise ValueError(f"--recipe {name}: {module} has no function {func}; {fix}")
    return fn()


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
    # a key the recipe's ConfigContainer lacks would be skipped by Bridge with a log line: the user's setting lost
    unknown = sorted(set(bridge_yaml) - set(merged.keys()))
    if unknown:
        raise ValueError(f"--config-file {a.config_file}: section(s) {', '.join(unknown)} are not part of the "
                         f"recipe's ConfigContainer (its sections: {', '.join(sorted(merged.keys()))}, and kd)")
    before = OmegaConf.to_container(merged)
    OmegaConf.set_struct(merged, True)  # a key of a section that has no such field is refused, not added
    try:
        merged = OmegaConf.merge(merged, OmegaConf.create(bridge_yaml))
    except Exception as e:  # noqa: BLE001  OmegaConf's errors: a key of a section that has no such field, a type
        raise ValueError(f"--config-file {a.config_file}: {_first_line(e)}") from None
    for item in bridge_overrides:
        try:
            merged = parse_hydra_overrides(merged, [item])
        except Exception as e:  # noqa: BLE001  Hydra's override grammar and OmegaConf's type checks
            raise ValueError(f"override {item!r}: {_first_line(e)}") from None
    problem = _type_problem(before, OmegaConf.to_container(merged, resolve=True))
    if problem:
        raise ValueError(problem)
    apply_overrides(cfg, OmegaConf.to_container(merged, resolve=True), excluded)
    notes = []
    if a.layers == "local" or (a.layers == "auto" and not have_te()):
        changed = use_local_layers(cfg.model)
        if changed:
            notes.append("Transformer Engine is not used here: " + ", ".join(changed))
    return cfg, kd, notes


def _kind(v):
    """What a value is, as the recipe's fields take it: an int also fits a float field."""
    return "bool" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) else \
        "text" if isinstance(v, str) else None


def _type_problem(before, after, key: str = "") -> str | None:
    """The first value the YAML or an override gives that is not the kind of the recipe's value there (a number
    field given text, say), which Bridge would take as it is and fail on later; None when all fit."""
    if isinstance(before, dict) and isinstance(after, dict):
        for k in before.keys() & after.keys():
            problem = _type_problem(before[k], after[k], f"{key}.{k}" if key else str(k))
            if problem:
                return problem
        return None
    a, b = _kind(before), _kind(after)
    if a and b and a != b:
        return (f"{key}={after!r}: the recipe's {key} is a {a} ({before!r}); give a {a} (YAML or override "
                f"{key}=...)")
    if a == "number" and b == "number" and isinstance(before, int) and not isinstance(after, int):
        return f"{key}={after!r}: the recipe's {key} is an integer ({before!r}); give an integer"
    return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


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
    from ..cache.errors import CacheError
    try:
        cfg, forward_step, a = build(argv)
    except (CacheError, ValueError) as e:  # bad input, refused before any work: one sentence, no traceback
        print(f"megatron_kd.bridge.run: error: {e}", file=sys.stderr)
        return 2
    from megatron.bridge.training.pretrain import pretrain

    callbacks = list(callbacks or [])
    if a.loss_log:
        from .callbacks import LossLog
        callbacks.append(LossLog(a.loss_log))
    pretrain(cfg, forward_step, callbacks=callbacks or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
