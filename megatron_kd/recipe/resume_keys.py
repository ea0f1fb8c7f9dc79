"""The recipe keys a resumed run compares with its checkpoint's (a change is refused unless train.resume_changes
names it; the student's architecture never changes): a view derived from the policy each schema field declares
(field_policy.py), never a list kept by hand. Paths may move with a copied run, and the cache's teacher is compared
by the identity its manifest records, not by its path."""
from dataclasses import fields

from .. import field_policy as fp
from .schema import ModelConfig, Recipe, TeacherConfig, TrainConfig

# the student's: its architecture (its weights come from the checkpoint)
ARCH_KEYS = fp.keys_of(ModelConfig, fp.ARCHITECTURE)
# architecture keys newer than some checkpoints: a checkpoint whose recipe lacks one was made at the key's schema
# default, so it is compared at that default instead of being skipped
ARCH_DEFAULTS = fp.absent_defaults(ModelConfig)
SCHEDULE_KEYS = fp.keys_of(TrainConfig, fp.SCHEDULE)
# the teacher's: its architecture and where its weights come from (its outputs are the targets)
TEACHER_KEYS = fp.keys_of(TeacherConfig, fp.ARCHITECTURE, fp.WEIGHTS)
# every other section: each field that is not free
RESUME_KEYS = {s.name: keys for s in fields(Recipe) if s.name not in ("model", "teacher")
               for keys in [tuple(f.name for f in fields(s.default_factory) if fp.policy(f) != fp.FREE)] if keys}

CACHE_TEACHER = "kd.cache teacher"


def resume_keys_all() -> list:
    out = [f"{s}.{k}" for s, keys in RESUME_KEYS.items() for k in keys]
    return out + [f"teacher.{k}" for k in TEACHER_KEYS] + [CACHE_TEACHER.replace(" ", "_")]
