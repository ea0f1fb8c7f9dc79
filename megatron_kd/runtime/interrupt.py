"""SIGTERM / SIGINT of a long command (`train`, `cache build`): unwind like KeyboardInterrupt (temp files removed,
locks released, the last checkpoint or finished shards kept), end the child processes the command started
(data-loader / spawn workers, multiprocessing's resource_tracker) and exit 128 + signal, so a rerun resumes."""
import os
import signal
import sys


class Interrupted(BaseException):
    """Raised in the main thread by the signal handler; BaseException, so `except Exception` does not swallow it."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def is_interrupt(e: BaseException) -> bool:
    """An exception that ends the command on purpose (Ctrl-C, SIGTERM, exit): never turned into an error message,
    also where BaseException is caught (torch's CheckpointException derives from it)."""
    return isinstance(e, (KeyboardInterrupt, SystemExit)) or type(e).__name__ == "Interrupted"


_received = []  # signals seen: a raise that lands in a finalizer ("Exception ignored in ...") is lost, this is not


def _on_signal(signum, frame):
    _received.append(signum)
    raise Interrupted(signum)


def end_children() -> None:
    """Terminate this process's multiprocessing children and its resource_tracker."""
    import multiprocessing
    children = multiprocessing.active_children()
    for c in children:
        c.terminate()
    for c in children:
        c.join(5)
    try:
        from multiprocessing import resource_tracker
        tracker = resource_tracker._resource_tracker
        if getattr(tracker, "_pid", None) is not None:
            os.kill(tracker._pid, signal.SIGTERM)
    except (ImportError, AttributeError, OSError):
        pass


def run_interruptible(fn, kept: str, fix: str = "rerun the same command to resume") -> int:
    """fn()'s return code; on SIGTERM/SIGINT: end the children, say what is kept (`kept`) and what to do (`fix`),
    and return 128 + signal."""
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    del _received[:]
    try:
        try:
            rc = fn()
            if not _received:
                return rc
            signum = _received[0]  # the raise was swallowed (it hit a finalizer); the command ran on to its end
        except Interrupted as e:
            signum = e.signum
        end_children()
        print(f"interrupted by {signal.Signals(signum).name}: {kept}; {fix}", file=sys.stderr)
        return 128 + signum
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
