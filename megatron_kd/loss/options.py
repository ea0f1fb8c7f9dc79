"""Loss options, checked once."""
from dataclasses import dataclass

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
