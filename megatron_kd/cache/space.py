"""How many bytes a cache takes, from its settings alone: before a build writes (free space, so a build that cannot
fit is refused before the teacher runs instead of failing with ENOSPC hours later) and before it starts at all
(`megatron-kd cache build --dry-run`).

The binary files are fully determined by the settings: a fixed-size encoding (fp16, fp32, compact) writes
num_samples x sample_bytes in its shards; a variable-size one (topp, sampled) writes between its smallest and
largest sample per sample (the kept ids per position decide where) plus, per shard, count + 1 uint64 offsets;
samples.idx holds 16 bytes per sample. The JSON files (settings, manifest, one sidecar per shard) come on top:
a few KiB each, not counted here.
"""
from ..rules import free_space
from .encoding import encoding_of
from .errors import CacheError
from .format import OFFSETS_DTYPE, SAMPLE_INDEX_DTYPE, num_shards, shard_range


def shard_bytes(settings: dict, encoding, count: int, largest: bool = True) -> int:
    """The bytes of a shard of count samples: exact for a fixed-size encoding; for a variable-size one its
    largest (largest=True) or smallest size, offsets table included."""
    if not encoding.variable:
        return count * encoding.sample_bytes
    per = encoding.max_bytes if largest else encoding.min_bytes
    return count * per + (count + 1) * OFFSETS_DTYPE.itemsize


def estimate_bytes(settings: dict) -> dict:
    """The binary bytes of the whole cache the settings (format.make_settings) describe, as the range
    [low, high] (equal for a fixed-size encoding), with the token count and the bytes per token of that range."""
    enc = encoding_of(settings)
    index = settings["num_samples"] * SAMPLE_INDEX_DTYPE.itemsize
    low = high = index
    for j in range(num_shards(settings)):
        first, stop = shard_range(settings, j)
        low += shard_bytes(settings, enc, stop - first, largest=False)
        high += shard_bytes(settings, enc, stop - first, largest=True)
    tokens = settings["num_samples"] * settings["seq_length"]
    return {"low": low, "high": high, "tokens": tokens, "shards": num_shards(settings),
            "bytes_per_token_low": low / tokens, "bytes_per_token_high": high / tokens, "variable": enc.variable}


def bytes_to_write(writer, shards) -> int:
    """A bound on what the shards still to write and the sample index take (largest samples)."""
    return (sum(shard_bytes(writer.settings, writer.encoding, writer.shard_range(j)[1] - writer.shard_range(j)[0])
                for j in shards)
            + writer.settings["num_samples"] * SAMPLE_INDEX_DTYPE.itemsize)


def check_free_space(writer, shards) -> None:
    """Call on every rank with the same shard list (all pending shards): every rank decides alike."""
    need = bytes_to_write(writer, shards)
    free, fits = free_space(writer.path, need)
    if not fits:
        raise CacheError(f"{writer.path} has {free / 2**30:.2f} GiB free, the cache's remaining shards need about "
                         f"{need / 2**30:.2f} GiB; free space there or build it elsewhere (finished shards are kept)")
