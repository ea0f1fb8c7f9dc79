"""Where a run's checkpoints lie (Megatron-LM's layout): iter_* directories and the tracker naming the latest."""
import os

TRACKER = "latest_checkpointed_iteration.txt"


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root) -> int | None:
    """The iteration the tracker names, None when `root` holds no complete checkpoint."""
    if not root:
        return None
    p = os.path.join(root, TRACKER)
    if not os.path.isfile(p):
        return None
    text = open(p).read().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise RuntimeError(f"{p} holds {text!r}, not an iteration number; fix or delete it") from None


def resolve(path: str) -> str:
    """A save dir (uses its tracker) or an iter_* dir -> the dist_checkpointing directory."""
    it = latest_iteration(path)
    if it is not None:
        d = iter_dir(path, it)
        return d if os.path.isdir(d) else os.path.join(path, "release")
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    raise FileNotFoundError(f"{path} is neither a checkpoint directory ({TRACKER}) nor a dist_checkpointing "
                            "iteration directory (metadata.json)")


def run_root(path: str) -> str:
    """The save dir a checkpoint belongs to: an iter_* (or release) directory's parent when that parent tracks
    checkpoints, else `path` itself (a save dir, or an iteration directory copied out on its own)."""
    p = os.path.abspath(path)
    parent = os.path.dirname(p)
    if os.path.basename(p).startswith(("iter_", "release")) and os.path.isfile(os.path.join(parent, TRACKER)):
        return parent
    return path
