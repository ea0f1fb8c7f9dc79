"""Loss options, checked once; KDLoss, the loss settings of a KD run (one schema for the recipe's `kd` section,
Bridge's `kd` section and the loss call)."""
import math
from dataclasses import dataclass, fields
from typing import Optional

from ..field_policy import free, targets
from ..rules import same_temperature, temperature_problem

TAILS = ("none", "renormalize", "bucket")
REDUCTIONS = ("mean", "sum", "none")
IMPLS = ("auto", "dense", "chunked", "forward_chunked", "fused")
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")  # docs/loss.md defines each on a sparse teacher, per tail


_FLOAT_KEYS = ("kl_weight", "ce_weight", "temperature", "jsd_beta", "cache_temperature")


def _as_float(key: str, value) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{key}={value!r} must be a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r} must be a number") from None


@dataclass
class KDLoss:
    """The loss keys of a KD run's `kd` section, one schema: megatron_kd.recipe.schema.KDConfig (recipes) and
    megatron_kd.bridge.OfflineKDConfig (Bridge YAMLs) extend it; loss_options() is the topk_kl_loss call's."""
    kl_weight: float = targets(1.0)              # ce mode trains on CE alone (weight 1)
    ce_weight: float = targets(0.0)              # adds this x CE on the labels
    temperature: float = targets(1.0)
    tail: str = targets("none")                  # none | renormalize | bucket (see topk_kl_loss)
    impl: str = free("auto")                     # auto | dense | chunked | forward_chunked | fused
    chunk_size: Optional[int] = free(None)
    divergence: str = targets("forward_kl")      # forward_kl | reverse_kl | jsd (docs/loss.md)
    jsd_beta: float = targets(0.5)               # jsd: the teacher's weight beta in (0, 1) (Liger's convention)
    cache_temperature: Optional[float] = targets(None)  # the T the cache was captured at (re-tempered to temperature)

    @property
    def capture_temperature(self) -> float:
        """The temperature the teacher's cache is captured at: cache_temperature when set (the loss re-tempers it
        to `temperature`), else `temperature`."""
        return self.temperature if self.cache_temperature is None else self.cache_temperature

    @property
    def kl_scale(self) -> float:
        """The divergence term's factor in the loss: T^2 x kl_weight (T^2 keeps the gradient's size the same
        across temperatures, as in Hinton et al.)."""
        t = float(self.temperature)
        return t * t * float(self.kl_weight)

    def loss_options(self, **overrides) -> "LossOptions":
        """The checked LossOptions of these keys (ValueError naming the key when one is wrong)."""
        kw = {f.name: getattr(self, f.name) for f in fields(KDLoss)}
        kw.update(overrides)
        return LossOptions(**kw)


@dataclass
class LossOptions(KDLoss):
    """One loss call's options, checked once: the run's loss keys (KDLoss) plus what only a call decides. The
    numbers are coerced to float here, naming the key when one is not a number. Read-only by convention: a
    changed copy is dataclasses.replace(opts, ...)."""
    reduction: str = "mean"
    ignore_index: int = -100
    monitor: bool = False  # also compute the bucket-tail forward KL (topk_kl_loss sets it given a metrics dict)

    def __post_init__(self):
        for key in _FLOAT_KEYS:
            value = getattr(self, key)
            if value is not None:
                setattr(self, key, _as_float(key, value))
        for key in ("kl_weight", "ce_weight"):
            w = getattr(self, key)
            if not (math.isfinite(w) and w >= 0):
                raise ValueError(f"{key}={w} must be a finite number >= 0 (a negative weight ascends its loss; 0 "
                                 "leaves the term out)")
        if self.tail not in TAILS:
            raise ValueError(f"tail={self.tail!r} is unknown; use one of {TAILS}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction={self.reduction!r} is unknown; use one of {REDUCTIONS}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} is unknown; use one of {IMPLS}")
        for key in ("temperature", "cache_temperature"):
            t = getattr(self, key)
            if key == "cache_temperature" and t is None:  # None: the cache was captured at the training temperature
                continue
            problem = temperature_problem(t)
            if problem:
                raise ValueError(f"{key}={t} {problem} (1 = the teacher's own distribution)")
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
    def ce_untempered(self) -> bool:
        """CE reads the untempered logits beside the divergence's z / T (a temperature of exactly 1 shares them)."""
        return self.needs_ce and self.temperature != 1.0

    @property
    def needs_rest(self) -> bool:
        """The student's mass outside the teacher's ids is needed (bucket tail, or the bucket-KL monitor)."""
        return self.tail == "bucket" or self.monitor

    @property
    def retemper(self) -> float | None:
        """T0 / T when the cache's log-probs must be re-tempered, else None."""
        if self.cache_temperature is None or same_temperature(self.cache_temperature, self.temperature):
            return None
        return float(self.cache_temperature) / float(self.temperature)
