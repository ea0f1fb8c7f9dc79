"""Teachers and the cache builds that run them: the teacher protocol (callable and HF teachers), the online and
Megatron teachers, the forward-only pipeline, and build_cache (any teacher, or a recipe's, over a dataset)."""
from .build import build_cache
from .protocol import CallableTeacher, HFTeacher, TeacherOutput

__all__ = ["build_cache", "CallableTeacher", "HFTeacher", "TeacherOutput"]
