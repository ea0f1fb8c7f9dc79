"""Guards of a training run: what must hold so that a run never trains on the wrong thing, and what it says when
it does not (one sentence naming the key and the fix).

- the train section's numbers (check_train: called by config.check_recipe)
- train.save: a writable directory (check_save_dir), held by one run at a time (save_lock)
- resuming: the checkpoint's recipe against this one (check_resume); train.resume_changes names intended changes
- checkpoints of other shapes (teacher.load, train.pretrained) refused before any model is built
- the corpus: long enough for data.seq_length, tokenized with data.tokenizer (check_corpus)
- NaN / inf in the loss or gradients (nonfinite_step, check_weights_finite): train.nonfinite = stop | skip
- free space before a checkpoint and a full disk reported as such (check_free_space, save_failed)
- SIGTERM / SIGINT during a checkpoint save: the save finishes, then the run ends (signals_deferred)

Every decision that ends a run is taken identically on every rank (the inputs are all-reduced first), so one
rank never raises while the others wait in a collective.
"""
import contextlib
import errno
import math
import os
import shutil
import signal
import socket
import threading

import torch
import torch.distributed as dist

from ..recipe.resume_keys import (ARCH_KEYS, CACHE_TEACHER, DEFAULTED_ARCH_KEYS, RESUME_KEYS, SCHEDULE_KEYS,
                                  TEACHER_KEYS)
from ..recipe.schema import RecipeError, RunError
from ..rules import free_space

LOCK_NAME = ".megatron-kd-train.lock"


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise RecipeError(msg)


# --- the train section's numbers -------------------------------------------------------------------------------


# --- train.save ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def save_lock(save: str, rank0: bool = True):
    """One run per train.save: an flock on <save>/.megatron-kd-train.lock, held by rank 0 while the run lasts
    (the kernel drops it when the process dies, so a killed run leaves no stale lock). A second run into the same
    directory is refused at once instead of interleaving its checkpoints and metrics with the first's."""
    if not rank0:
        yield
        return
    import fcntl
    path = os.path.join(save, LOCK_NAME)
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        owner = f.read().strip() or "another process"
        f.close()
        raise RecipeError(f"train.save={save} is in use by another megatron-kd train ({owner}); wait for that run "
                          "to end, or give this one another train.save") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}")
        f.flush()
        yield
    finally:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        f.close()


# --- resuming --------------------------------------------------------------------------------------------------


def _uses_teacher(kd: dict) -> bool:
    return kd.get("mode") == "online" or (kd.get("mode") == "offline" and bool(kd.get("build_cache")))


def cache_teacher(kd) -> dict | None:
    """The teacher identity the offline cache's manifest records (None: no finished cache, or not offline)."""
    if getattr(kd, "mode", None) != "offline" or not kd.cache:
        return None
    try:
        from ..cache.reader import load_manifest
        return load_manifest(kd.cache).get("teacher")
    except Exception:  # noqa: BLE001  an unfinished or broken cache is the cache checks' to report
        return None


def _fmt(v) -> str:
    return "null" if v is None else str(v)


def _with_defaults(saved_model: dict) -> dict:
    """A checkpoint's model section with DEFAULTED_ARCH_KEYS it lacks set to their schema defaults."""
    import dataclasses
    from ..recipe.schema import ModelConfig
    if not saved_model:
        return saved_model
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    return {**{k: defaults[k] for k in DEFAULTED_ARCH_KEYS}, **saved_model}


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
        if section == "kd" and n.get("mode") == "ce" and s.get("mode") == "ce":
            keys = ("mode",)  # CE-only runs read no other kd key
        for k in keys:
            if k in s and s[k] != n[k]:
                diff.append((f"{section}.{k}", s[k], n[k]))
    sk, nk = saved.get("kd", {}), now["kd"]
    if _uses_teacher(sk) and _uses_teacher(nk):
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
    names it; returns the notes (one per intended change) to log. The architecture cannot be changed at all."""
    saved = common.get("recipe") or {}
    diff = resume_differences(saved, r, common.get("cache_teacher"))
    arch = [d for d in diff if d[0].startswith("model.")]
    if arch:
        raise RecipeError(f"train.load={load} holds a checkpoint of another model ("
                          + ", ".join(f"{k}: {a} there, {b} here" for k, a, b in arch)
                          + "); use another train.save or the checkpoint's model settings")
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


def check_checkpoint_model(path: str, m, key: str, section: str) -> None:
    """A checkpoint loaded as weights only (teacher.load, train.pretrained) must hold the architecture of `section`;
    refused before any model is built, naming both shapes."""
    from ..checkpoint import store as ckpt
    try:
        common = ckpt.read_common(path)
    except FileNotFoundError as e:
        raise RecipeError(f"{key}={path}: {e}") from None
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or type(e).__name__ == "Interrupted":
            raise
        raise RecipeError(f"{key}={path}: its checkpoint cannot be read ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); point {key} at a complete "
                          "`megatron-kd train` save dir") from None
    saved = _with_defaults((common.get("recipe") or {}).get("model", {}))
    diff = [(k, saved[k], getattr(m, k)) for k in ARCH_KEYS if k in saved and saved[k] != getattr(m, k)]
    if diff:
        raise RecipeError(f"{key}={path} holds a model of another shape ("
                          + ", ".join(f"{k}: {a} there, {section}.{k}={b} here" for k, a, b in diff)
                          + f"); set {section}'s architecture to the checkpoint's, or point {key} at a matching "
                          "checkpoint")


# --- data ------------------------------------------------------------------------------------------------------

def _prefixes(path) -> list:
    paths = [path] if isinstance(path, str) else [str(x) for x in path]
    if len(paths) > 1:
        try:
            float(paths[0])
            return paths[1::2]
        except ValueError:
            pass
    return paths


def check_corpus(d, tok) -> None:
    """Indexed data: tokenized with this run's tokenizer (the .json sidecar `megatron-kd data prepare` writes
    records its hash), and at least one sample of data.seq_length + 1 tokens long (else Megatron's index repeats
    the corpus without end building one sample)."""
    if d.kind != "indexed" or not d.path:
        return
    import json
    total = 0
    for p in _prefixes(d.path):
        side = p + ".json"
        meta = {}
        if os.path.isfile(side):
            try:
                meta = json.load(open(side))
            except ValueError:
                meta = {}
        want = getattr(tok, "sha", None)
        got = meta.get("tokenizer_sha256")
        if got and want and want != "mock" and got != want:
            raise RecipeError(f"data.path={p} was tokenized with another tokenizer ({meta.get('tokenizer')}, sha256 "
                              f"{got}) than data.tokenizer={d.tokenizer} (sha256 {want}); set data.tokenizer to the "
                              "one the data was prepared with, or prepare the data again with this tokenizer")
        if isinstance(meta.get("tokens"), int):
            total += meta["tokens"]
        else:
            from megatron.core.datasets.indexed_dataset import IndexedDataset
            ds = IndexedDataset(p, mmap=True)  # held while its memory-mapped lengths are read
            total += int(ds.sequence_lengths.sum())
            del ds
    if d.seq_length + 1 > total:
        raise RecipeError(f"data.seq_length={d.seq_length} is longer than the whole corpus ({total} tokens in "
                          f"data.path); lower data.seq_length below {total} or add data")


# --- NaN / inf -------------------------------------------------------------------------------------------------

def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _all_agree_bad(bad) -> bool:
    """True on every rank when any rank found a problem (bad: a bool, or a 0-d tensor on the device: one host
    sync for the whole check)."""
    flag = (bad if torch.is_tensor(bad) else torch.tensor(bool(bad))).to(_device(), torch.float32).reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def _grad_buffers(chunks):
    for c in chunks:
        for b in list(getattr(c, "buffers", []) or []) + list(getattr(c, "expert_parallel_buffers", []) or []):
            if getattr(b, "grad_data", None) is not None:
                yield b.grad_data


def _grads_nonfinite(chunks):
    """A 0-d tensor (on the grads' device), nonzero when any gradient is NaN/inf; no host sync."""
    flags = [(~torch.isfinite(g)).any() for g in _grad_buffers(chunks)]
    return torch.stack(flags).any() if flags else torch.tensor(False)


def nonfinite_step(losses: dict, chunks, t, iteration: int) -> str | None:
    """Before the optimizer step: why this step's loss or gradients are not finite (None when they are). Under
    train.nonfinite=stop this raises, before any weight is touched, so NaN weights are never trained or saved.
    fp16 runs leave gradient overflow to the loss scaler (a skipped step there is normal)."""
    reasons = [f"loss {k} = {v}" for k, v in losses.items() if isinstance(v, float) and not math.isfinite(v)]
    grads_bad = _grads_nonfinite(chunks) if t.precision != "fp16" else False
    if _all_agree_bad(grads_bad):
        reasons.append("gradients hold NaN/inf")
    if not reasons:
        return None
    why = ", ".join(reasons)
    if t.nonfinite == "stop":
        clip = ", set train.clip_grad > 0 (0: no clipping)" if not t.clip_grad else ""
        raise RunError(f"iteration {iteration}: {why}; the run stops before this update (no NaN weights are "
                       f"trained or saved; the last checkpoint is kept): lower train.lr (now {t.lr:g}){clip}, "
                       "or set train.nonfinite=skip to skip such updates")
    return why


def check_weights_finite(chunks, iteration: int) -> None:
    """Before a checkpoint: every weight finite (on every rank), so no NaN weights are ever saved."""
    flags = [(~torch.isfinite(p.data)).any() for c in chunks for p in c.parameters()]
    if _all_agree_bad(torch.stack(flags).any() if flags else False):
        raise RunError(f"iteration {iteration}: the weights hold NaN/inf, so no checkpoint is written (the last "
                       "one is kept); lower train.lr or set train.clip_grad > 0 and resume from it")


# --- disk space ------------------------------------------------------------------------------------------------

def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def checkpoint_bytes(save: str, chunks, optimizer) -> int:
    """The size of the next checkpoint: the last one's on disk, else the parameters plus the optimizer state
    (all ranks' shares; replicas counted once)."""
    from ..checkpoint import store as ckpt
    it = ckpt.latest_iteration(save)
    if it is not None and os.path.isdir(ckpt.iter_dir(save, it)):
        return dir_bytes(ckpt.iter_dir(save, it))
    local = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(o, "optimizer", None)
        for st in getattr(inner, "state", {}).values():
            local += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        if not getattr(inner, "state", None):  # no state yet: fp32 Adam moments and main params
            local += 12 * sum(p.numel() for c in chunks for p in c.parameters())
    if dist.is_initialized():
        from megatron.core import parallel_state as ps
        local *= ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
    return int(local * 1.05)


def check_free_space(save: str, need: int, iteration: int) -> None:
    free, fits = free_space(save, need)
    if _all_agree_bad(not fits):
        raise RunError(f"train.save={save} has {free / 2**30:.2f} GiB free, the checkpoint of iteration {iteration} "
                       f"needs about {need / 2**30:.2f} GiB; free space there or point train.save elsewhere and "
                       "resume (the last checkpoint is kept)")


def _is_enospc(e: BaseException) -> bool:
    seen = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(x)
        if "No space left on device" in text or "ENOSPC" in text:
            return True
        stack += [x.__cause__, x.__context__]
        for v in (getattr(x, "rank_to_errors", None) or {}).values():  # CheckpointException's per-rank errors
            stack += [err for err in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(err, BaseException)]
    return False


def disk_full(e: BaseException, path: str, free_floor: int = 64 << 20) -> bool:
    """A failed write is taken for a full disk when it says so, or when the filesystem has (almost) nothing free
    (some writers report ENOSPC as a position mismatch)."""
    if _is_enospc(e):
        return True
    try:
        return shutil.disk_usage(path).free < free_floor
    except OSError:
        return False


def save_failed(e: BaseException, save: str, iteration: int) -> BaseException:
    """The error to raise for a checkpoint save that failed: a full disk named as such, else the error itself."""
    if _is_interrupt(e):
        return e
    if disk_full(e, save):
        return RunError(f"no space left on the device of train.save={save} while writing iteration {iteration}'s "
                        "checkpoint (the partial one is removed, the last complete one is kept); free space or "
                        "point train.save elsewhere, then rerun to resume")
    return e


def _is_interrupt(e: BaseException) -> bool:
    return isinstance(e, (KeyboardInterrupt, SystemExit)) or type(e).__name__ == "Interrupted"


# --- signals during a save -------------------------------------------------------------------------------------

@contextlib.contextmanager
def signals_deferred():
    """SIGTERM / SIGINT that arrive while a checkpoint is written are held until it is complete (tracker
    included), then end the run as they would have: an exception raised inside the writer's threads, queues or
    finalizers is otherwise swallowed, or tears the checkpoint."""
    from ..runtime import interrupt
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.getsignal(s) for s in sigs}
    held = []

    def hold(signum, frame):
        held.append(signum)
        interrupt._received.append(signum)

    for s in sigs:
        signal.signal(s, hold)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if held and any(h is interrupt._on_signal for h in previous.values()):
        raise interrupt.Interrupted(held[0])
    if held:
        for s in held[:1]:
            os.kill(os.getpid(), s)  # not under `megatron-kd train`: the caller's own handler decides


def stop_if_signalled() -> None:
    """A SIGTERM / SIGINT whose raise was swallowed (it landed in a finalizer) ends the run at the next
    iteration instead of after the last one."""
    from ..runtime import interrupt
    if interrupt._received and signal.getsignal(signal.SIGTERM) is interrupt._on_signal:
        raise interrupt.Interrupted(interrupt._received[0])


# --- the call sites' entry points ------------------------------------------------------------------------------

def check_inputs(r, tok) -> None:
    """preflight: the corpus, and the checkpoints loaded as weights only, before any model is built."""
    check_corpus(r.data, tok)
    if r.kd.mode == "online" and r.teacher.load and not r.teacher.hf_path:
        check_checkpoint_model(r.teacher.load, r.teacher, "teacher.load", "teacher")
    if r.train.pretrained and not r.model.hf_path:
        check_checkpoint_model(r.train.pretrained, r.model, "train.pretrained", "model")


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
        if _is_interrupt(e):
            raise
        raise RunError(f"train.load={root}: {d}/common.pt cannot be read ({type(e).__name__}); resume from another "
                       "save dir (train.load), or start over with another train.save") from None


def remove_partial(save: str, iteration: int, rank0: bool) -> None:
    """After a failed save: its directory, unless the tracker names it (then it is a complete earlier save)."""
    from ..checkpoint import store as ckpt
    d = ckpt.iter_dir(save, iteration)
    if rank0 and ckpt.latest_iteration(save) != iteration and os.path.isdir(d):
        shutil.rmtree(d, ignore_errors=True)


# --- recipe files ----------------------------------------------------------------------------------------------


# --- the checkpoint writer's helper process --------------------------------------------------------------------

_writer_manager = None


def _die_with_parent() -> None:
    """In the writer's Manager process: the kernel kills it when the run's process dies (kill -9 included)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run ends it; a Ctrl-C to the process group must not


def checkpoint_writer_ready() -> None:
    """megatron-core's async checkpoint writer collects results through a multiprocessing Manager it starts once
    per process and keeps. Started here instead, so that (a) it dies with the run (a killed run otherwise leaves it
    and multiprocessing's resource_tracker alive under init), and (b) one ended by an interrupt is replaced before
    the next save in the same process (a dead one fails that save with BrokenPipeError)."""
    global _writer_manager
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        return
    alive = _writer_manager is not None and _writer_manager._process is not None and \
        _writer_manager._process.is_alive()
    if alive and getattr(fa, "_results_queue", None) is not None:
        return
    import multiprocessing
    from multiprocessing.managers import SyncManager
    m = SyncManager(ctx=multiprocessing.get_context("fork"))
    m.start(initializer=_die_with_parent)
    _writer_manager = m
    fa._results_queue = m.Queue()


def load_failed(e: BaseException, load: str, iteration: int) -> BaseException:
    """The error to raise for a resume whose checkpoint megatron-core could not read (one saved without a checksum
    manifest, so not verified first): one sentence instead of EOFError / AssertionError / CheckpointException."""
    if _is_interrupt(e):
        return e
    first = (str(e).strip().splitlines() or [""])[0][:200]
    from ..checkpoint import store as ckpt
    return RunError(f"train.load={load}: iteration {iteration}'s checkpoint cannot be loaded ({type(e).__name__}: "
                    f"{first}); it is damaged or incomplete: move {ckpt.iter_dir(load, iteration)} aside and point "
                    f"{ckpt.TRACKER} at an earlier iteration to resume from there, or start over with another "
                    "train.save")
