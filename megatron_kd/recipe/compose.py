"""Where recipes live, which names refer to one, and how to compose one outside the Hydra app (demo, tests,
factories, plan)."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def recipes_dir() -> Path:
    """$MEGATRON_KD_RECIPES, else the checkout's recipes/ (megatron-kd is installed editable)."""
    env = os.environ.get("MEGATRON_KD_RECIPES")
    return Path(env).resolve() if env else ROOT / "recipes"


def recipe_file(name: str, directory: Path | None = None) -> Path | None:
    """The recipe a name refers to: the file itself for a path ending in .yaml/.yml, else DIRECTORY/NAME.yaml
    (DIRECTORY: recipes_dir()) for a bare name; None when there is none."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        return p if p.is_file() else None
    if "/" in name or "\\" in name:
        return None
    cand = Path(directory or recipes_dir()) / f"{name}.yaml"
    return cand if cand.is_file() else None


def known_recipes(directory: Path | None = None) -> list:
    d = Path(directory or recipes_dir())
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def missing_recipe(name: str, directory: Path | None = None) -> str | None:
    """None when `name` refers to a recipe (recipe_file), else the one-line error listing the known ones."""
    if recipe_file(name, directory) is not None:
        return None
    if Path(name).suffix in (".yaml", ".yml"):
        return f"recipe file {name!r} does not exist"
    d = Path(directory or recipes_dir())
    return f"no recipe {name!r} in {d}; known: {', '.join(known_recipes(d)) or 'none'}"


def missing_keys(cfg) -> list:
    """`section.key` of every value a composed recipe leaves `???` (the user must give it)."""
    from omegaconf import OmegaConf
    return [f"{sec}.{k}" for sec in cfg if sec != "hydra" and OmegaConf.is_dict(cfg[sec])
            for k in cfg[sec] if OmegaConf.is_missing(cfg[sec], k)]


SECTIONS = ("model", "teacher", "parallel", "data", "kd", "train", "quant")


def schema_overrides(overrides) -> list:
    """`section.key=value` -> `++section.key=value`: a schema key can be set even when the recipe's group file
    leaves it out (its schema default applies otherwise). Misspelt keys still fail, in the schema check, by name."""
    out = []
    for o in overrides:
        key = o.split("=", 1)[0]
        if "=" in o and not o.startswith(("+", "~")) and "@" not in key and key.split(".")[0] in SECTIONS \
                and "." in key:
            o = "++" + o
        out.append(o)
    return out


def compose(name: str = "tiny_cpu", overrides=(), save: str | None = None):
    """The recipe `name` with Hydra overrides, as `megatron-kd train --config-name name ...` sees it.

    train.save defaults to runs/<name> (the app's hydra.run.dir) since there is no Hydra run here.
    """
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict
    overrides = schema_overrides(overrides)
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
