"""Resuming a run: where it starts (the newest intact checkpoint of train.load), and what must hold first: a save
directory holding another run's checkpoints is never reused (check_save_and_load), the checkpoint's recipe against
this one (check_resume; train.resume_changes names intended changes, the architecture never changes, nor the layer
spec the checkpoint records: checkpoint/spec.py), checkpoints loaded as weights only (teacher.load, train.pretrained)
of this architecture and spec (check_checkpoint_model), and after the load the recipe's schedule and Adam settings
where they were changed on purpose.

The keys compared are those the schema's fields declare (recipe/resume_keys.py derives them; the recipe's checks
name them too); checkpoint/integrity.py decides which checkpoint is intact.
"""
import os

from ..checkpoint import integrity as ckpt_integrity, spec as layer_spec, store as ckpt
from ..errors import RecipeError, RunError
from ..recipe.resume_keys import ARCH_DEFAULTS, ARCH_KEYS, CACHE_TEACHER, RESUME_KEYS, SCHEDULE_KEYS, TEACHER_KEYS
from ..recipe.targets import TargetSource
from ..runtime.interrupt import is_interrupt


def check_save_and_load(save: str, load: str) -> None:
    """A save directory that holds another run's checkpoints is never resumed into from elsewhere."""
    latest_save = ckpt.latest_iteration(save)
    if os.path.abspath(load) != os.path.abspath(save) and latest_save is not None:
        raise RecipeError(f"train.save={save} already holds checkpoints of a run (iteration {latest_save}) and "
                          f"train.load={load} points elsewhere: resuming into it would mix two runs; use another "
                          "train.save, or resume that run (train.load = train.save)")


def load_state(r, load: str, chunks, optimizer, scheduler, rank0: bool) -> tuple[int, int, list]:
    """(iteration, consumed samples, notes) a run starts from, its state loaded: the newest intact checkpoint of
    `load` (a damaged latest one is passed over with a note, and the tracker moves to the one used), checked
    against the recipe first; none: train.pretrained's weights when given, from iteration 0."""
    it, fallback = ckpt_integrity.newest_intact(load)
    if it is None:
        if r.train.pretrained:
            ckpt.load_spec_weights(r.train.pretrained, chunks, f"train.pretrained={r.train.pretrained}",
                                    "model.attention_backend={}")
            optimizer.reload_model_params()
        return 0, 0, []
    if fallback and rank0:
        print(f"note: {fallback[0]}", flush=True)
    if it != ckpt.latest_iteration(load):
        ckpt_integrity.use_iteration(load, it, rank0)
    common = read_common_at(load, it)
    notes = check_resume(r, load, common)
    if schedule_changed(common, r):  # intended (train.resume_changes): the recipe's schedule applies
        scheduler.override_opt_param_scheduler = True
    try:
        common = ckpt.load_checkpoint(load, chunks, optimizer, scheduler)
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        raise load_failed(e, load, it, chunks) from e
    apply_optimizer_settings(optimizer, r.train)
    return int(common["iteration"]), int(common["consumed_samples"]), notes


def cache_teacher(kd) -> dict | None:
    """The teacher identity the offline cache's manifest records (None: no finished cache, or not offline)."""
    if not TargetSource.of(kd).reads_cache or not kd.cache:
        return None
    try:
        from ..cache.reader import load_manifest
        return load_manifest(kd.cache).get("teacher")
    except Exception:  # noqa: BLE001  an unfinished or broken cache is the cache checks' to report
        return None


def _fmt(v) -> str:
    return "null" if v is None else str(v)


def _with_defaults(saved_model: dict) -> dict:
    """A checkpoint's model section with the ARCH_DEFAULTS keys it lacks set to their schema defaults."""
    if not saved_model:
        return saved_model
    return {**ARCH_DEFAULTS, **saved_model}


def resume_differences(saved: dict, r, saved_cache_teacher=None) -> list:
    """[(key, checkpoint's value, this recipe's value)] for every compared key that differs."""
    import dataclasses
    now = dataclasses.asdict(r)
    diff = []
    sm, nm = _with_defaults(saved.get("model", {})), now["model"]
    for k in ARCH_KEYS:
        if k in sm and sm[k] != nm[k]:
            diff.append((f"model.{k}", sm[k], nm[k]))
    for section, keys in RESUME_KEYS.items():
        s, n = saved.get(section, {}), now[section]
        if section == "kd" and not TargetSource.of(n).distills and not TargetSource.of(s).distills:
            keys = ("mode",)  # CE-only runs read no other kd key
        for k in keys:
            if k in s and s[k] != n[k]:
                diff.append((f"{section}.{k}", s[k], n[k]))
    sk, nk = saved.get("kd", {}), now["kd"]
    if TargetSource.of(sk).needs_teacher and TargetSource.of(nk).needs_teacher:
        st, nt = _with_defaults(saved.get("teacher", {})), now["teacher"]
        for k in TEACHER_KEYS:
            if k in st and st[k] != nt[k]:
                diff.append((f"teacher.{k}", st[k], nt[k]))
    if saved_cache_teacher is not None:
        current = cache_teacher(r.kd)
        if current is not None and current != saved_cache_teacher:
            diff.append((CACHE_TEACHER.replace(" ", "_"), saved_cache_teacher, current))
    return diff


def check_resume(r, load: str, common: dict) -> list:
    """Refuse a resume whose recipe differs from the checkpoint's in a compared key, unless train.resume_changes
    names it; returns the notes (one per intended change) to log. The architecture cannot be changed at all, nor
    the layer spec the checkpoint records (checkpoint/spec.py: model.attention_backend=auto builds another one
    where Transformer Engine's import differs)."""
    saved = common.get("recipe") or {}
    diff = resume_differences(saved, r, common.get("cache_teacher"))
    arch = [d for d in diff if d[0].startswith("model.")]
    if arch:
        raise RecipeError(f"train.load={load} holds a checkpoint of another model ("
                          + ", ".join(f"{k}: {a} there, {b} here" for k, a, b in arch)
                          + "); use another train.save or the checkpoint's model settings")
    spec = layer_spec.refusal(common, r.model, f"train.load={load}: iteration {common.get('iteration', '?')}'s "
                              "checkpoint", "model.attention_backend={}")
    if spec:
        raise RecipeError(spec)
    allowed = set(r.train.resume_changes)
    refused = [d for d in diff if d[0] not in allowed]
    if refused:
        it = common.get("iteration", "?")
        what = "; ".join(f"{k}={_fmt(a)} there, {_fmt(b)} here" for k, a, b in refused)
        keys = ",".join(k for k, _, _ in refused)
        raise RecipeError(
            f"train.load={load} holds iteration {it} of a run with other settings ({what}): resuming would mix "
            f"two runs; set {' and '.join(f'{k}={_fmt(a)}' for k, a, _ in refused)} to resume it exactly, give "
            f"this run another train.save, or set train.resume_changes=[{keys}] to change it on purpose")
    return [f"resuming with a changed setting on purpose (train.resume_changes): {k} {_fmt(a)} -> {_fmt(b)}"
            for k, a, b in diff]


def check_against_save(r, save: str) -> None:
    """What a run refuses of the checkpoints already in its save dir and the one it would resume from, before any
    model is built: `megatron-kd train` asks it before Hydra writes the run directory's records (a refused run
    would rewrite those of the finished run there), run() again."""
    load = r.train.load or save
    check_save_and_load(save, load)
    check_resume_early(r, load)


def check_resume_early(r, load: str) -> None:
    """Before any model is built: the checkpoint a resume would start from (sizes checked, not yet hashed) must
    have been trained with this recipe's settings. _resume repeats the comparison on the checkpoint it loads."""
    from ..checkpoint.integrity import newest_intact
    it, _ = newest_intact(load, checksums=False)
    if it is not None:
        check_resume(r, load, read_common_at(load, it))


def read_common_at(root: str, iteration: int) -> dict:
    from megatron.core import dist_checkpointing
    from ..checkpoint import store as ckpt
    d = ckpt.iter_dir(root, iteration)
    try:
        return dist_checkpointing.load_common_state_dict(d)
    except BaseException as e:
        if is_interrupt(e):
            raise
        raise RunError(f"train.load={root}: {d}/common.pt cannot be read ({type(e).__name__}); resume from another "
                       "save dir (train.load), or start over with another train.save") from None


def schedule_changed(common: dict, r) -> bool:
    """True when the resumed run changes the LR schedule on purpose: the recipe's schedule then replaces the
    checkpoint's (megatron-core's scheduler otherwise keeps the checkpoint's values)."""
    saved = (common.get("recipe") or {}).get("train", {})
    return any(k in saved and saved[k] != getattr(r.train, k) for k in SCHEDULE_KEYS)


def apply_optimizer_settings(optimizer, t) -> None:
    """After a load, the recipe's Adam betas / eps (a checkpoint restores its own with the param groups); the
    scheduler sets lr and weight decay at every step."""
    for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(o, "optimizer", None)
        for g in getattr(inner, "param_groups", []):
            if "betas" in g:
                g["betas"] = (t.adam_beta1, t.adam_beta2)
            if "eps" in g:
                g["eps"] = t.adam_eps


def load_failed(e: BaseException, load: str, iteration: int, chunks=None) -> BaseException:
    """The error to raise for a resume whose checkpoint megatron-core could not load into `chunks` (the model built):
    one sentence instead of EOFError / AssertionError / CheckpointException. A checkpoint that records no layer spec
    (older runs) and misses a weight the specs name differently was likely saved on another spec: its fix is
    model.attention_backend, and moving it aside would throw a good checkpoint away. Otherwise (one saved without a
    checksum manifest, so not verified first) it is damaged."""
    if is_interrupt(e):
        return e
    what = f"train.load={load}: iteration {iteration}'s checkpoint"
    hint = layer_spec.spec_hint(e, chunks, what, "model.attention_backend={}")
    if hint:
        return RunError(hint)
    return RunError(f"{what} cannot be loaded ({layer_spec.summary(e)}); it is damaged or incomplete: move "
                    f"{ckpt.iter_dir(load, iteration)} aside and point {ckpt.TRACKER} at an earlier iteration to "
                    "resume from there, or start over with another train.save")


def check_checkpoint_model(path: str, m, key: str, section: str) -> None:
    """A checkpoint loaded as weights only (teacher.load, train.pretrained) must hold the architecture of `section`
    and have been saved on the layer spec `section` builds here; refused before any model is built, naming both."""
    from ..checkpoint import store as ckpt
    try:
        common = ckpt.read_common(path)
    except FileNotFoundError as e:
        raise RecipeError(f"{key}={path}: {e}") from None
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        if is_interrupt(e):
            raise
        raise RecipeError(f"{key}={path}: its checkpoint cannot be read ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); point {key} at a complete "
                          "`megatron-kd train` save dir") from None
    from ..checkpoint.integrity import require_intact
    require_intact(path, key, checksums=False)  # files and sizes, before any model is built (load_weights hashes)
    saved = _with_defaults((common.get("recipe") or {}).get("model", {}))
    diff = [(k, saved[k], getattr(m, k)) for k in ARCH_KEYS if k in saved and saved[k] != getattr(m, k)]
    if diff:
        raise RecipeError(f"{key}={path} holds a model of another shape ("
                          + ", ".join(f"{k}: {a} there, {section}.{k}={b} here" for k, a, b in diff)
                          + f"); set {section}'s architecture to the checkpoint's, or point {key} at a matching "
                          "checkpoint")
    spec = layer_spec.refusal(common, m, f"{key}={path}", f"{section}.attention_backend={{}}")
    if spec:
        raise RecipeError(spec)

