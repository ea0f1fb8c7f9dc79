"""The one reading of a teacher spec, as `megatron-kd cache build --teacher` and Bridge's cache command take it:
  hf:DIR          a local Hugging Face checkpoint through transformers (HFTeacher)
  mkd:SAVE_DIR    a `megatron-kd train` save dir (or iter_* dir) as a Megatron teacher
  module:function a factory returning a teacher (teacher.protocol), called with the JSON args
"""
import importlib


def factory(spec: str):
    """The function `module:function` names; ValueError naming the problem when it does not."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{spec!r} is not `module:function` (e.g. mypkg.teachers:make_teacher)")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {spec!r} ({e}); check the module is on PYTHONPATH") from None


def check_kwargs(fn, args: dict, flag: str) -> None:
    """ValueError naming the keys of `args` that `fn` takes no parameter for (none when it takes **kwargs)."""
    import inspect
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): the call itself says
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    bad = sorted(set(args) - set(names))
    if bad:
        raise ValueError(f"{flag} has key(s) {', '.join(map(repr, bad))} that {getattr(fn, '__qualname__', fn)} "
                         f"does not take; it takes {', '.join(names) or 'none'}")


def make_teacher(spec: str, args: dict, vocab_size: int | None = None, seq_length: int | None = None):
    """The teacher `spec` names (see the module docstring), built with `args`; vocab_size and seq_length are the
    run's, for a mkd: teacher."""
    if spec.startswith("mkd:"):
        check_kwargs(megatron_kd_teacher, {"save_dir": 0, **args}, "--teacher-args")
        kw = {"vocab_size": vocab_size, "seq_length": seq_length, **args}
        if kw["vocab_size"] is None or kw["seq_length"] is None:
            raise ValueError(f"--teacher {spec} needs the run's vocab_size and seq_length: give them in "
                             "--teacher-args, e.g. '{\"vocab_size\": 128256, \"seq_length\": 8192}'")
        return megatron_kd_teacher(spec[4:], **kw)
    if spec.startswith("hf:"):
        import torch
        from .protocol import HFTeacher
        check_kwargs(HFTeacher.__init__, {"self": 0, "model_dir": 0, **args}, "--teacher-args")
        kw = dict(args)
        if "device" not in kw and torch.cuda.is_available():
            kw["device"] = f"cuda:{torch.cuda.current_device()}"
        if isinstance(kw.get("dtype"), str):
            kw["dtype"] = getattr(torch, kw["dtype"])
        return HFTeacher(spec[3:], **kw)
    fn = factory(spec)
    check_kwargs(fn, args, "--teacher-args")
    return fn(**args)


def megatron_kd_teacher(save_dir: str, vocab_size: int, seq_length: int, tp: int = 1, precision: str = "bf16",
                        device: str = "auto", attention_backend: str | None = None):
    """A `megatron-kd train` save dir (or iter_* dir) as a Megatron teacher: the model section of the recipe it
    saved, its weights (any layout they were saved at), tensor parallel over `tp` ranks of this job; the other
    ranks split the samples (data parallel). Built on the layer spec its checkpoint records (checkpoint/spec.py):
    the saved recipe's attention_backend (auto) would build Transformer Engine's spec or not by what imports here.
    attention_backend (te, sdpa, local) chooses the spec of a checkpoint that records none (older runs)."""
    import dataclasses
    from ..checkpoint import spec as layer_spec, store as ckpt
    from ..recipe.schema import DataConfig, ParallelConfig, Recipe, TeacherConfig, TrainConfig
    from .megatron import start_cache_teacher
    from ..runtime.interrupt import is_interrupt
    try:
        common = ckpt.read_common(save_dir)
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        if is_interrupt(e):
            raise
        raise ValueError(f"--teacher mkd:{save_dir}: its checkpoint cannot be read ({layer_spec.summary(e)}); point "
                         "it at a `megatron-kd train` save dir or one of its iter_* directories") from None
    saved = (common.get("recipe") or {}).get("model")
    if not saved:
        raise ValueError(f"--teacher mkd:{save_dir}: no recipe in its checkpoint (not a `megatron-kd train` save dir)")
    known = {f.name for f in dataclasses.fields(TeacherConfig)}
    teacher = TeacherConfig(**{k: v for k, v in saved.items() if k in known})
    teacher.hf_path, teacher.load = None, save_dir
    names = (f"--teacher mkd:{save_dir}", "--teacher-args '{{\"attention_backend\": \"{}\"}}'")
    layer_spec.build_as_saved(common, teacher, attention_backend, *names)  # before any process group or model
    r = Recipe(teacher=teacher, parallel=ParallelConfig(tp=int(tp)), data=DataConfig(seq_length=int(seq_length)),
               train=TrainConfig(precision=precision, device=device))
    return start_cache_teacher(r, vocab_size, names=names)
