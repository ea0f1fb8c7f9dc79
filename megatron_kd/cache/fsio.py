"""Crash-safe file commits: write a temporary file, fsync it, os.replace it over the target, fsync the directory.

A reader (or a restarted build) sees either the old file or the complete new one, never a torn write.
Temporary names are unique per process and opened exclusively ("xb"), so a leftover temp file is never
appended to or reused; the builder holding the directory's lock deletes leftovers (remove_temp_files).

Test seam: `set_fault_hook(fn)` installs fn(event) called at every file operation of the cache writer
("settings:written" = temp file complete, not yet renamed; "settings:committed"; "sample"; "shard:written";
"shard:committed"; "sidecar:written"; ...), so tests can kill the process there. None (the default) = no calls.
"""
import json
import os
import uuid

TMP_SUFFIX = ".tmp"
_fault_hook = None


def set_fault_hook(fn):
    """Install fn(event: str) (None removes it); returns the previous hook. For tests only."""
    global _fault_hook
    previous, _fault_hook = _fault_hook, fn
    return previous


def fault_point(event: str) -> None:
    if _fault_hook is not None:
        _fault_hook(event)


def temp_name(path) -> str:
    """A temporary sibling of path, unique to this process and call: NAME.<pid>-<random>.tmp."""
    return f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"


def open_temp(path):
    """(file opened for exclusive creation, its name): never an existing file."""
    tmp = temp_name(path)
    return open(tmp, "xb"), tmp


def remove_temp_files(directory) -> list[str]:
    """Delete the temp files (*.tmp) a killed writer left in directory; returns their names."""
    removed = []
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            if name.endswith(TMP_SUFFIX):
                os.remove(os.path.join(directory, name))
                removed.append(name)
    return removed


def try_lock(path):
    """An exclusive flock on `path` (created if missing) without waiting: its fd, or None when another process
    holds it. The kernel drops it when the fd is closed or the process dies, so a killed holder leaves no stale
    lock."""
    import fcntl
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def fsync_dir(path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems cannot open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(tmp_path, final_path) -> None:
    """Atomically move a finished, fsynced temporary file into place."""
    os.replace(tmp_path, final_path)
    fsync_dir(os.path.dirname(os.path.abspath(final_path)))


def write_bytes_atomic(path, data: bytes, event: str = "file") -> None:
    f, tmp = open_temp(path)
    try:
        with f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        fault_point(f"{event}:written")
        commit(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fault_point(f"{event}:committed")


def dumps(obj) -> str:
    # Sorted keys and no timestamps: the same build always writes the same bytes.
    return json.dumps(obj, indent=1, sort_keys=True) + "\n"


def write_json_atomic(path, obj, event: str = "file") -> None:
    write_bytes_atomic(path, dumps(obj).encode(), event)


def read_json(path):
    with open(path) as f:
        return json.load(f)
