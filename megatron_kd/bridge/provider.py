"""The Bridge DatasetProvider that adds cache rows to the user's own dataset config. Imports Bridge (load it
through wrap_dataset_config when a Bridge config is wrapped). A module-level class, so Bridge's saved run config
names it (`_target_`) and a resumed run rebuilds it.

The user's config (`base`, e.g. GPTDatasetConfig) stays the one that builds the samples. Bridge reads and writes
dataset settings on cfg.dataset (setup sets `tokenizer` and `token_dtype_code`, validation `pad_to_max_length`,
...): reads of a name the provider does not have go to `base`, and so do writes (a write to a dataloader field
both have goes to both)."""
import dataclasses

from megatron.bridge.data.base import DatasetProvider
from megatron.bridge.data.utils import get_dataset_provider
from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

from .config import OfflineKDConfig
from .data import build_kd_datasets


@dataclasses.dataclass(kw_only=True)
class OfflineKDDatasetProvider(DatasetProvider):
    base: object = None
    """The user's dataset config (GPTDatasetConfig, ...), built exactly as Bridge would build it."""
    kd: OfflineKDConfig = dataclasses.field(default_factory=OfflineKDConfig)

    def finalize(self) -> None:
        if hasattr(self.base, "finalize"):
            self.base.finalize()
        super().finalize()

    def build_datasets(self, context):
        return build_kd_datasets(self.base, self.kd, context, get_dataset_provider(self.base))

    def to_cfg_dict(self) -> dict:
        """Bridge's run config (run_config.yaml in each checkpoint): this provider with `base` and `kd` inside,
        each in Bridge's own serialization (`_target_` + fields), so it loads back as it was."""
        from megatron.bridge.training.config import ConfigContainer
        out = {"_target_": f"{type(self).__module__}.{type(self).__qualname__}"}
        for f in dataclasses.fields(self):
            if f.init and not f.name.startswith("_"):
                out[f.name] = ConfigContainer._convert_value_to_dict(getattr(self, f.name))
        return out

    def __getattr__(self, name):
        # seq_length, tokenizer, random_seed, ...: whatever Bridge reads from a dataset config, the user's has.
        base = self.__dict__.get("base")
        if base is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(base, name)

    def __setattr__(self, name, value):
        base = self.__dict__.get("base")
        if name in _OWN:
            object.__setattr__(self, name, value)
            if base is not None and name in _SHARED and hasattr(base, name):
                setattr(base, name, value)  # a dataloader field both have: keep them equal
        elif base is not None and hasattr(base, name):
            setattr(base, name, value)  # Bridge's `cfg.dataset.tokenizer = tokenizer` reaches the user's config
        else:
            object.__setattr__(self, name, value)


# Bridge instantiates `_target_`s of a saved run config (ConfigContainer.from_yaml) only from allowed packages.
register_allowed_target_prefix("megatron_kd.bridge")

_OWN = frozenset(f.name for f in dataclasses.fields(OfflineKDDatasetProvider))
_SHARED = _OWN - {"base", "kd"}  # DataloaderConfig's fields


def wrap_dataset_config(base, kd: OfflineKDConfig) -> OfflineKDDatasetProvider:
    """cfg.dataset -> a provider that builds it as before and adds the cache rows to the train split."""
    if isinstance(base, OfflineKDDatasetProvider):
        raise ValueError("cfg.dataset already carries offline KD (enable_offline_kd was called twice)")
    # The dataloader settings (workers, sharding, pinning, ...) stay the user's: copy the ones both have.
    names = {f.name for f in dataclasses.fields(OfflineKDDatasetProvider) if f.init} - {"base", "kd"}
    loader = {k: getattr(base, k) for k in names if hasattr(base, k)}
    return OfflineKDDatasetProvider(base=base, kd=kd, **loader)
