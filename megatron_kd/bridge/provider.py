"""The Bridge DatasetProvider that adds cache rows to the user's own dataset config. Imports Bridge: load it only
through wrap_dataset_config (api.enable_offline_kd does). A module-level class, so Bridge's saved run config can name it (_target_)."""
import dataclasses

from megatron.bridge.data.base import DatasetProvider
from megatron.bridge.data.utils import get_dataset_provider

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

    def __getattr__(self, name):
        # seq_length, tokenizer settings, ...: whatever Bridge reads from a dataset config, the user's has.
        base = self.__dict__.get("base")
        if base is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(base, name)


def wrap_dataset_config(base, kd):
    """cfg.dataset -> a provider that builds it as before and adds the cache rows to the train split."""
    # The dataloader settings (workers, sharding, pinning, ...) stay the user's: copy the ones both have.
    names = {f.name for f in dataclasses.fields(OfflineKDDatasetProvider) if f.init} - {"base", "kd"}
    loader = {k: getattr(base, k) for k in names if hasattr(base, k)}
    return OfflineKDDatasetProvider(base=base, kd=kd, **loader)
