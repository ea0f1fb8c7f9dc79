"""The `kd` section a Bridge user adds next to their ConfigContainer. Plain dataclass: no Bridge import."""
from dataclasses import asdict, dataclass, fields
from typing import Optional

from ..recipe.schema import OfflineKD
from ..rules import top_k_fits


@dataclass
class OfflineKDConfig(OfflineKD):
    """Offline top-K distillation settings of a Bridge run: the recipes' `kd` keys (recipe.schema.OfflineKD:
    the loss keys, cache, top_k, check_tokens, log_ce, with the same defaults) plus Bridge's own below. The
    cache's capture temperature is checked against temperature / cache_temperature before any step."""

    cache_path: Optional[str] = None
    """Alias of `cache`, in the *_path style of Bridge's own path keys; a YAML may give either (not both)."""
    eval_with_lm_loss: bool = True
    """Validation batches (no cache rows) use the plain LM loss instead of failing."""

    def __post_init__(self):
        if self.cache_path is not None:
            if self.cache is not None and self.cache != self.cache_path:
                raise ValueError(f"kd.cache={self.cache!r} and kd.cache_path={self.cache_path!r} name two caches; "
                                 "give one of them (cache_path is an alias of cache)")
            self.cache, self.cache_path = self.cache_path, None

    def validate(self) -> "OfflineKDConfig":
        if not self.cache:
            raise ValueError("kd.cache is required: the directory of the teacher top-K cache")
        if self.top_k is not None and not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
                                           and top_k_fits(self.top_k)):
            raise ValueError(f"kd.top_k={self.top_k!r} must be a positive integer (or null: the cache's K)")
        try:
            self.loss_options()
        except ValueError as e:
            raise ValueError(f"kd: {e}") from None
        return self

    @classmethod
    def from_dict(cls, values: dict | None) -> "OfflineKDConfig":
        if values is not None and not isinstance(values, dict):
            raise ValueError(f"the kd section is a {type(values).__name__}, not a mapping of kd keys (e.g. "
                             "kd: {cache: /data/kd/teacher_top100, top_k: 100})")
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown kd key(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


def split_kd_overrides(overrides: list) -> tuple[list, list]:
    """Hydra-style overrides split into ours (`kd.x=...`, prefix dropped) and Bridge's (everything else)."""
    ours, theirs = [], []
    for item in overrides:
        key = item.lstrip("+~").split("=", 1)[0]
        if key == "kd" or key.startswith("kd."):
            ours.append(item)
        else:
            theirs.append(item)
    return ours, theirs


def apply_kd_overrides(kd: OfflineKDConfig, overrides: list) -> OfflineKDConfig:
    """`kd.top_k=64 kd.cache=/data/c` onto a config; values parse as YAML scalars (64 -> int, null -> None)."""
    import yaml

    values = kd.to_dict()
    given = {}  # key -> the override that set it: two overrides of one key (the alias included) must agree
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"kd override {item!r} needs the form kd.<key>=<value>")
        key, raw = item.lstrip("+").split("=", 1)
        key = key[len("kd."):]
        key = "cache" if key == "cache_path" else key  # the alias overrides what the YAML's cache says
        if key not in values:
            raise ValueError(f"unknown kd key {key!r} in {item!r}; known: {sorted(values)}")
        value = yaml.safe_load(raw) if raw != "" else ""
        if key in given and value != values[key]:
            raise ValueError(f"{given[key]} and {item} set kd.{key} twice to other values; give it once")
        given[key] = item
        values[key] = value
    return OfflineKDConfig.from_dict(values)
