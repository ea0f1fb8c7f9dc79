"""The recipes a name may refer to, the one-line error for a name that is none of them, and the values a recipe
leaves to the user (train, launch)."""
from pathlib import Path


def known_recipes(directory: Path) -> list:
    return sorted(p.stem for p in Path(directory).glob("*.yaml")) if Path(directory).is_dir() else []


def missing_recipe(name: str, directory: Path) -> str | None:
    """None when `name` is a recipe in `directory` or an existing .yaml path, else the message listing them."""
    if name.endswith((".yaml", ".yml")):
        return None if Path(name).is_file() else f"recipe file {name!r} does not exist"
    if (Path(directory) / f"{name}.yaml").is_file():
        return None
    return f"no recipe {name!r} in {directory}; known: {', '.join(known_recipes(directory)) or 'none'}"


def missing_keys(cfg) -> list:
    """`section.key` of every value a composed recipe leaves `???` (the user must give it)."""
    from omegaconf import OmegaConf
    return [f"{sec}.{k}" for sec in cfg if sec != "hydra" and OmegaConf.is_dict(cfg[sec])
            for k in cfg[sec] if OmegaConf.is_missing(cfg[sec], k)]
