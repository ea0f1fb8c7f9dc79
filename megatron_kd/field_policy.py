"""What each recipe field is to a resumed run. Every field of every recipe section (recipe/schema.py, and the loss
keys it shares with Bridge, loss/options.py) is declared through one of the constructors below, which records its
policy in the field's metadata; the resume comparison (training/resume.py) derives the keys it compares from them,
and a field declared without one fails the schema's test. A plain module at the foot of the package so that the
loss keys below the recipe can declare theirs too.

    num_layers: int = architecture(2)
"""
from dataclasses import MISSING, field, fields, is_dataclass

KEY = "resume"
ABSENT_IS_DEFAULT = "absent_is_default"

ARCHITECTURE = "architecture"
WEIGHTS = "weights"
DATA = "data"
TARGETS = "targets"
SCHEDULE = "schedule"
UPDATES = "updates"
FREE = "free"
POLICIES = (ARCHITECTURE, WEIGHTS, DATA, TARGETS, SCHEDULE, UPDATES, FREE)


def _field(policy: str, default, factory, metadata: dict):
    return field(default=default, default_factory=factory, metadata={KEY: policy, **metadata})


def architecture(default=MISSING, *, factory=MISSING, absent_is_default: bool = False, **metadata):
    """The model itself: a run resumed with another value would train another model, so the student's never
    changes on resume, and a checkpoint loaded as weights (teacher.load, train.pretrained) must hold the same.
    absent_is_default: a key newer than some checkpoints, which were made at its default (compared at it)."""
    return _field(ARCHITECTURE, default, factory, {**metadata, ABSENT_IS_DEFAULT: absent_is_default})


def weights(default=MISSING, *, factory=MISSING, **metadata):
    """Where a model's weights come from: compared for the teacher (its outputs are the targets); a resumed
    student's weights come from its checkpoint instead, so the student's are not compared."""
    return _field(WEIGHTS, default, factory, metadata)


def data(default=MISSING, *, factory=MISSING, **metadata):
    """What the run trains on: the corpus, its tokenization and its order."""
    return _field(DATA, default, factory, metadata)


def targets(default=MISSING, *, factory=MISSING, **metadata):
    """What the student is taught: the mode, the loss and the teacher's targets it reads."""
    return _field(TARGETS, default, factory, metadata)


def schedule(default=MISSING, *, factory=MISSING, **metadata):
    """The learning-rate schedule: a change made on purpose replaces the checkpoint's scheduler state."""
    return _field(SCHEDULE, default, factory, metadata)


def updates(default=MISSING, *, factory=MISSING, **metadata):
    """How each update is made: the optimizer and its settings, the batch, the precision of the stored state."""
    return _field(UPDATES, default, factory, metadata)


def free(default=MISSING, *, factory=MISSING, **metadata):
    """How and where the run goes (paths, logging, parallel layout, kernels, memory, what a finished cache records
    for itself): may change on resume."""
    return _field(FREE, default, factory, metadata)


def policy(f) -> str | None:
    """The policy a dataclass field declares (None: none declared)."""
    return f.metadata.get(KEY)


def keys_of(cls, *wanted: str) -> tuple:
    """The names of `cls`'s fields whose policy is one of `wanted` (ARCHITECTURE, DATA, ...), in field order."""
    return tuple(f.name for f in fields(cls) if policy(f) in wanted)


def absent_defaults(cls) -> dict:
    """{name: default} of `cls`'s fields compared at their default where a checkpoint's recipe lacks them."""
    return {f.name: f.default for f in fields(cls) if f.metadata.get(ABSENT_IS_DEFAULT)}


def unclassified(cls, prefix: str = "") -> list:
    """Dotted names of the fields under dataclass `cls` (nested sections included) that declare no known policy;
    a section (a field holding a dataclass) is classified through its own fields."""
    out = []
    for f in fields(cls):
        inner = f.default_factory() if f.default_factory is not MISSING else None
        if is_dataclass(inner):
            out += unclassified(type(inner), f"{prefix}{f.name}.")
        elif policy(f) not in POLICIES:
            out.append(prefix + f.name)
    return out
