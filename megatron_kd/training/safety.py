"""Safety of a run's files and processes: one run per train.save (save_lock), a save directory that can be
written (check_save_dir), free space before a checkpoint and a full disk reported as such (check_free_space,
save_failed), a failed save's partial directory removed (remove_partial), SIGTERM / SIGINT held while a checkpoint
is written (signals_deferred) and the checkpoint writer's helper process tied to the run (checkpoint_writer_ready).

Every decision that ends a run is taken identically on every rank (the inputs are all-reduced first: all_agree_bad),
so one rank never raises while the others wait in a collective.
"""
import contextlib
import os
import shutil
import signal
import socket
import threading

import torch
import torch.distributed as dist

from ..errors import RecipeError, RunError
from ..rules import free_space, out_of_room
from ..runtime.interrupt import is_interrupt

LOCK_NAME = ".megatron-kd-train.lock"


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


def check_save_dir(save: str) -> None:
    """train.save must be a directory this process can write (made when missing), before any model is built."""
    if os.path.exists(save) and not os.path.isdir(save):
        raise RecipeError(f"train.save={save} is a file, not a directory; point train.save at a directory (it is "
                          "made when missing)")
    parent = save
    while not os.path.exists(parent):
        parent = os.path.dirname(os.path.abspath(parent))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RecipeError(f"train.save={save}: {parent} is not writable (read-only filesystem or permissions); "
                          "point train.save at a writable directory")
    try:
        os.makedirs(save, exist_ok=True)
        probe = os.path.join(save, f".write-probe-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise RecipeError(f"train.save={save} cannot be written ({e.strerror or e}); point train.save at a "
                          "writable directory") from None


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def all_agree_bad(bad) -> bool:
    """True on every rank when any rank found a problem (bad: a bool, or a 0-d tensor on the device: one host
    sync for the whole check)."""
    flag = (bad if torch.is_tensor(bad) else torch.tensor(bool(bad))).to(_device(), torch.float32).reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


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
    if all_agree_bad(not fits):
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
        if out_of_room(x):
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
    if is_interrupt(e):
        return e
    if disk_full(e, save):
        return RunError(f"no space left on the device of train.save={save} while writing iteration {iteration}'s "
                        "checkpoint (the partial one is removed, the last complete one is kept); free space or "
                        "point train.save elsewhere, then rerun to resume")
    return e


def remove_partial(save: str, iteration: int, rank0: bool) -> None:
    """After a failed save: its directory, unless the tracker names it (then it is a complete earlier save)."""
    from ..checkpoint import store as ckpt
    d = ckpt.iter_dir(save, iteration)
    if rank0 and ckpt.latest_iteration(save) != iteration and os.path.isdir(d):
        shutil.rmtree(d, ignore_errors=True)


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


_writer_manager = None
_forking_pid = None


def _pdeathsig() -> None:
    """In a process this run forked: the kernel kills it when its parent dies (kill -9 included). A parent that
    died between the fork and this call left it under another parent already: it ends now."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if _forking_pid is not None and os.getppid() != _forking_pid:
        os._exit(1)


def _remember_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def children_die_with_run() -> None:
    """Every process this run forks from now on (megatron-core's async checkpoint writer and its write workers,
    data loader workers, the writer's Manager) dies with the process that forked it. A run killed with kill -9
    during a save otherwise leaves a writer under init, still writing into the save directory. Once per process
    (forked children inherit the hooks, so their own children do the same)."""
    if getattr(children_die_with_run, "_on", False):
        return
    os.register_at_fork(before=_remember_forking_pid, after_in_child=_pdeathsig)
    children_die_with_run._on = True


def _die_with_parent() -> None:
    """In the writer's Manager process: the kernel kills it when the run's process dies (kill -9 included)."""
    _pdeathsig()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run ends it; a Ctrl-C to the process group must not


def checkpoint_writer_ready() -> None:
    """megatron-core's async checkpoint writer collects results through a multiprocessing Manager it starts once
    per process and keeps. Started here instead, so that (a) it dies with the run (a killed run otherwise leaves it
    and multiprocessing's resource_tracker alive under init), and (b) one ended by an interrupt is replaced before
    the next save in the same process (a dead one fails that save with BrokenPipeError)."""
    global _writer_manager
    children_die_with_run()
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

