"""The `kd` section a Bridge user adds next to their ConfigContainer. Plain dataclass: no Bridge import."""
from dataclasses import asdict, dataclass, fields

from ..loss import KDLoss


@dataclass
class OfflineKDConfig(KDLoss):
    """Offline top-K distillation settings; the loss keys (kl_weight, ce_weight, temperature, tail, impl,
    chunk_size) are loss.KDLoss's, the same schema as the recipes' `kd` section. temperature must equal the
    temperature the cache was captured at (checked before any step)."""

    cache_path: str = ""
    """Teacher top-K cache (a directory with manifest.json) built over the same training dataset."""
    top_k: int | None = None
    """K to train with: None takes the cache's; a smaller K keeps each row's most probable entries."""
    check_tokens: bool = True
    """Compare each sample's token hash with the cache's: catches a cache built for other data."""
    log_ce: bool = False
    """Also report the student's CE and KL apart: one extra forward-only pass over the output layer per
    micro-batch (off by default: at 32K x 128K vocab that pass is not free)."""
    eval_with_lm_loss: bool = True
    """Validation batches (no cache rows) use the plain LM loss instead of failing."""

    def validate(self) -> "OfflineKDConfig":
        if not self.cache_path:
            raise ValueError("kd.cache_path is required: the directory of the teacher top-K cache")
        if self.top_k is not None and int(self.top_k) < 1:
            raise ValueError(f"kd.top_k={self.top_k} must be a positive integer (or null: the cache's K)")
        try:
            self.loss_options()
        except ValueError as e:
            raise ValueError(f"kd: {e}") from None
        return self

    @classmethod
    def from_dict(cls, values: dict | None) -> "OfflineKDConfig":
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
    """`kd.top_k=64 kd.cache_path=/data/c` onto a config; values parse as YAML scalars (64 -> int, null -> None)."""
    import yaml

    values = kd.to_dict()
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"kd override {item!r} needs the form kd.<key>=<value>")
        key, raw = item.lstrip("+").split("=", 1)
        key = key[len("kd."):]
        if key not in values:
            raise ValueError(f"unknown kd key {key!r} in {item!r}; known: {sorted(values)}")
        values[key] = yaml.safe_load(raw) if raw != "" else ""
    return OfflineKDConfig.from_dict(values)
