"""Where recipes live and how to compose one outside the Hydra app (demo, tests, factories)."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def recipes_dir() -> Path:
    """$MEGATRON_KD_RECIPES, else the checkout's recipes/ (megatron-kd is installed editable)."""
    env = os.environ.get("MEGATRON_KD_RECIPES")
    return Path(env).resolve() if env else ROOT / "recipes"


def compose(name: str = "tiny_cpu", overrides=(), save: str | None = None):
    """The recipe `name` with Hydra overrides, as `megatron-kd train --config-name name ...` sees it.

    train.save defaults to runs/<name> (the app's hydra.run.dir) since there is no Hydra run here.
    """
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict
    overrides = list(overrides)
    path = Path(name)
    cfg_dir, cfg_name = (path.parent.resolve(), path.stem) if path.suffix in (".yaml", ".yml") else \
        (recipes_dir(), name)
    with initialize_config_dir(config_dir=str(cfg_dir), version_base="1.3"):
        cfg = hydra_compose(config_name=cfg_name, overrides=overrides)
    if save is not None or not any(o.split("=", 1)[0].lstrip("+") == "train.save" for o in overrides):
        with open_dict(cfg):
            cfg.train.save = save or f"runs/{cfg_name}"
    OmegaConf.resolve(cfg)
    return cfg
