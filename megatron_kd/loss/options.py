"""Loss options, checked once; KDLoss, the loss settings of a KD run (one schema for the recipe's `kd` section,
Bridge's `kd` section and the loss call)."""
from dataclasses import dataclass, fields
from typing import Optional

TAILS = ("none", "renormalize", "bucket")
REDUCTIONS = ("mean", "sum", "none")
IMPLS = ("auto", "dense", "chunked", "forward_chunked", "fused")


@dataclass(frozen=True)
class LossOptions:
    kl_weight: float = 1.0
    ce_weight: float = 0.0
    temperature: float = 1.0
    tail: str = "none"
    reduction: str = "mean"
    impl: str = "auto"
    chunk_size: int | None = None
    ignore_index: int = -100

    def __post_init__(self):
        if self.tail not in TAILS:
            raise ValueError(f"tail={self.tail!r} is unknown; use one of {TAILS}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction={self.reduction!r} is unknown; use one of {REDUCTIONS}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} is unknown; use one of {IMPLS}")
        if not float(self.temperature) > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")
        if self.chunk_size is not None and int(self.chunk_size) < 1:
            raise ValueError(f"chunk_size={self.chunk_size} must be a positive number of tokens")

    @property
    def needs_ce(self) -> bool:
        return self.ce_weight != 0.0

    @property
    def needs_kl(self) -> bool:
        return self.kl_weight != 0.0


@dataclass
class KDLoss:
    """The loss keys of a KD run's `kd` section, one schema: megatron_kd.megatron.config.KDConfig (recipes) and
    megatron_kd.bridge.OfflineKDConfig (Bridge YAMLs) extend it; loss_options() is the topk_kl_loss call's."""
    kl_weight: float = 1.0                       # ce mode trains on CE alone (weight 1)
    ce_weight: float = 0.0                       # adds this x CE on the labels
    temperature: float = 1.0
    tail: str = "none"                           # none | renormalize | bucket (see topk_kl_loss)
    impl: str = "auto"                           # auto | dense | chunked | forward_chunked | fused
    chunk_size: Optional[int] = None

    def loss_options(self, **overrides) -> LossOptions:
        """The checked LossOptions of these keys (ValueError naming the key when one is wrong)."""
        kw = {f.name: getattr(self, f.name) for f in fields(KDLoss)}
        kw.update(overrides)
        return LossOptions(kl_weight=float(kw["kl_weight"]), ce_weight=float(kw["ce_weight"]),
                           temperature=float(kw["temperature"]), tail=kw["tail"], impl=kw["impl"],
                           chunk_size=kw["chunk_size"])
