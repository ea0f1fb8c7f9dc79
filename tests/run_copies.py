"""Helpers of the tests that copy a finished training run and resume or load it."""
import shutil

from megatron_kd.checkpoint import store as ckpt
from megatron_kd.training import safety


def one_sentence(msg: str) -> None:
    assert "Traceback" not in msg and "\n" not in msg.strip(), msg


def copy_at(finished, dst, iteration: int | None = None):
    """A copy of the finished run (its cache path follows train.save), its tracker set back to `iteration`."""
    shutil.copytree(finished, dst, ignore=shutil.ignore_patterns(safety.LOCK_NAME))
    if iteration is not None:
        (dst / ckpt.TRACKER).write_text(str(iteration))
    return dst
