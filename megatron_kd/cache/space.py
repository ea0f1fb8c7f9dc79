"""Free space before a cache build writes: the shards still to write have a known size (samples x sample_bytes,
plus the 16-byte index entry per sample), so a build that cannot fit is refused before the teacher runs instead
of failing with ENOSPC hours later."""
from ..rules import free_space
from .errors import CacheError
from .format import SAMPLE_INDEX_DTYPE


def bytes_to_write(writer, shards) -> int:
    samples = sum(writer.shard_range(j)[1] - writer.shard_range(j)[0] for j in shards)
    return samples * writer.settings["sample_bytes"] + writer.settings["num_samples"] * SAMPLE_INDEX_DTYPE.itemsize


def check_free_space(writer, shards) -> None:
    """Call on every rank with the same shard list (all pending shards): every rank decides alike."""
    need = bytes_to_write(writer, shards)
    free, fits = free_space(writer.path, need)
    if not fits:
        raise CacheError(f"{writer.path} has {free / 2**30:.2f} GiB free, the cache's remaining shards need about "
                         f"{need / 2**30:.2f} GiB; free space there or build it elsewhere (finished shards are kept)")
