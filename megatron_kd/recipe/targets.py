"""Where the loss's targets come from, decided once from the kd section, with the questions the code asks of it.

    offline  the teacher's top-K rows, read from a cache (built first by the teacher when kd.build_cache=true)
    online   a frozen teacher beside the student computes its top-K every step
    ce       none: cross-entropy on the labels alone

The mode names are what users write (kd.mode, a run's summary, the demo's student names); the code asks the object
instead of comparing them. This module imports nothing, so the planner asks it without loading torch.
"""
from dataclasses import dataclass

MODES = ("offline", "online", "ce")


@dataclass(frozen=True)
class TargetSource:
    mode: str                   # one of MODES: offline | online | ce
    builds_cache: bool = False  # offline: the teacher builds the cache first (kd.build_cache=true)

    @classmethod
    def of(cls, kd) -> "TargetSource":
        """From a KDConfig or its dict (a checkpoint's recipe, a run's summary)."""
        get = kd.get if isinstance(kd, dict) else (lambda key, default=None: getattr(kd, key, default))
        mode = get("mode")
        return cls(mode, cls(mode).reads_cache and bool(get("build_cache")))

    @property
    def known(self) -> bool:
        return self.mode in MODES

    @property
    def reads_cache(self) -> bool:
        """Targets come from a top-K cache (kd.cache)."""
        return self.mode == "offline"

    @property
    def teacher_each_step(self) -> bool:
        """A teacher beside the student computes the targets at every step (at kd.temperature)."""
        return self.mode == "online"

    @property
    def needs_teacher(self) -> bool:
        """The run loads a teacher model: beside the student, or to build the cache first."""
        return self.teacher_each_step or self.builds_cache

    @property
    def distills(self) -> bool:
        """The loss has teacher slots (K, temperature and the KL weights mean something)."""
        return self.mode != "ce"
