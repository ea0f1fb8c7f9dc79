"""Loss options, checked once; KDLoss, the loss settings of a KD run (one schema for the recipe's `kd` section,
Bridge's `kd` section and the loss call)."""
import math
from dataclasses import dataclass, fields
from typing import Optional

TAILS = ("none", "renormalize", "bucket")
REDUCTIONS = ("mean", "sum", "none")
IMPLS = ("auto", "dense", "chunked", "forward_chunked", "fused")
TEMPERATURE_RANGE = (1e-3, 1e3)  # beyond it logits / T overflow or the distribution is a one-hot / uniform
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")  # docs/loss.md defines each on a sparse teacher, per tail


def _number(key: str, v, allow_none: bool = False):
    """v as a float, or a ValueError naming the key (float('half') alone names nothing)."""
    if v is None and allow_none:
        return None
    try:
        if isinstance(v, bool):
            raise TypeError
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={v!r} must be a number") from None


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
    # divergences (issue 20): the divergence, JSD's teacher weight beta (Liger's convention), the temperature the
    # cache was captured at (None: the training temperature; otherwise the cache is re-tempered, an approximation:
    # docs/loss.md), and whether to also compute the bucket-tail forward KL for monitoring (topk_kl_loss sets it
    # when given a metrics dict)
    divergence: str = "forward_kl"
    jsd_beta: float = 0.5
    cache_temperature: float | None = None
    monitor: bool = False

    def __post_init__(self):
        for key in ("kl_weight", "ce_weight", "temperature", "jsd_beta", "cache_temperature"):
            _number(key, getattr(self, key), allow_none=key == "cache_temperature")
        if self.tail not in TAILS:
            raise ValueError(f"tail={self.tail!r} is unknown; use one of {TAILS}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction={self.reduction!r} is unknown; use one of {REDUCTIONS}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} is unknown; use one of {IMPLS}")
        lo_t, hi_t = TEMPERATURE_RANGE
        for key in ("temperature", "cache_temperature"):
            t = getattr(self, key)
            if key == "cache_temperature" and t is None:  # None: the cache was captured at the training temperature
                continue
            if not (isinstance(t, (int, float)) and math.isfinite(t) and lo_t <= t <= hi_t):
                raise ValueError(f"{key}={t} must be a finite number in [{lo_t:g}, {hi_t:g}] (1 = the teacher's own "
                                 "distribution)")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence={self.divergence!r} is unknown; use one of {DIVERGENCES}")
        if self.divergence == "jsd" and not 0.0 < float(self.jsd_beta) < 1.0:
            raise ValueError(f"jsd_beta={self.jsd_beta} must be in (0, 1); Liger's beta=0 is divergence='forward_kl', "
                             "beta=1 is divergence='reverse_kl'")
        if self.chunk_size is not None and int(self.chunk_size) < 1:
            raise ValueError(f"chunk_size={self.chunk_size} must be a positive number of tokens")

    @property
    def needs_ce(self) -> bool:
        return self.ce_weight != 0.0

    @property
    def needs_kl(self) -> bool:
        return self.kl_weight != 0.0

    @property
    def needs_rest(self) -> bool:
        """The student's mass outside the teacher's ids is needed (bucket tail, or the bucket-KL monitor)."""
        return self.tail == "bucket" or self.monitor

    @property
    def retemper(self) -> float | None:
        """T0 / T when the cache's log-probs must be re-tempered, else None."""
        if self.cache_temperature is None or float(self.cache_temperature) == float(self.temperature):
            return None
        return float(self.cache_temperature) / float(self.temperature)

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
    divergence: str = "forward_kl"               # forward_kl | reverse_kl | jsd (docs/loss.md)
    jsd_beta: float = 0.5                        # jsd: the teacher's weight beta in (0, 1) (Liger's convention)
    cache_temperature: Optional[float] = None    # the T the cache was captured at, to re-temper it to temperature

    @property
    def capture_temperature(self) -> float:
        """The temperature the teacher's cache is captured at: cache_temperature when set (the loss re-tempers it
        to `temperature`), else `temperature`."""
        return self.temperature if self.cache_temperature is None else self.cache_temperature

    def loss_options(self, **overrides) -> LossOptions:
        """The checked LossOptions of these keys (ValueError naming the key when one is wrong)."""
        kw = {f.name: getattr(self, f.name) for f in fields(KDLoss)}
        kw.update(overrides)
        return LossOptions(kl_weight=_number("kl_weight", kw["kl_weight"]),
                           ce_weight=_number("ce_weight", kw["ce_weight"]),
                           temperature=_number("temperature", kw["temperature"]), tail=kw["tail"], impl=kw["impl"],
                           chunk_size=kw["chunk_size"], divergence=kw["divergence"],
                           jsd_beta=_number("jsd_beta", kw["jsd_beta"]),
                           cache_temperature=_number("cache_temperature", kw["cache_temperature"], allow_none=True))
