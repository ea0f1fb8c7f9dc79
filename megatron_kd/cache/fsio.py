"""Crash-safe file commits: write a temporary file, fsync it, os.replace it over the target, fsync the directory.

A reader (or a restarted build) sees either the old file or the complete new one, never a torn write.
"""
import json
import os


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


def write_bytes_atomic(path, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    commit(tmp, path)


def dumps(obj) -> str:
    # Sorted keys and no timestamps: the same build always writes the same bytes.
    return json.dumps(obj, indent=1, sort_keys=True) + "\n"


def write_json_atomic(path, obj) -> None:
    write_bytes_atomic(path, dumps(obj).encode())


def read_json(path):
    with open(path) as f:
        return json.load(f)
