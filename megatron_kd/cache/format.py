"""The cache directory layout and its settings (the part of the manifest that defines a cache).

DIR/build.lock           held (flock) by the one builder of the directory; empty
DIR/settings.json        what the build was asked for; written first, compared on every restart
DIR/shards/NNNNNN.bin    samples [first, first + count): count x sample_bytes, no header; a variable-size
                         encoding (topp) writes the samples back to back, then count + 1 uint64 offsets
DIR/shards/NNNNNN.json   the shard's sidecar: the settings (and their hash) it was built with, checksum,
                         per-sample token hash + crc32, statistics; its presence with this build's settings
                         hash (and a .bin of the right size) marks the shard as done
DIR/samples.idx          per sample: uint64 token hash, uint32 crc32 of its bytes, uint32 0 (16 bytes)
DIR/manifest.json        settings + shards + checksums + statistics; written last: its presence = finished
"""
import os

import numpy as np

from ..rules import temperature_problem
from .encoding import ENCODINGS, setting_keys
from .errors import CacheError
from .hashing import config_hash

FORMAT = "megatron-kd-topk-cache"
FORMAT_VERSION = 2  # 2: settings_hash in the manifest, its shards and sidecars
SETTINGS = "settings.json"
MANIFEST = "manifest.json"
SAMPLE_INDEX = "samples.idx"
SHARD_DIR = "shards"
LOCK = "build.lock"
SAMPLE_INDEX_DTYPE = np.dtype([("token_hash", "<u8"), ("crc32", "<u4"), ("reserved", "<u4")])
DEFAULT_SHARD_BYTES = 256 << 20

# Every key of settings.json (make_settings), in the order messages list them; all must match for a restart to
# continue a build, and a manifest must agree with settings.json on each.
SETTINGS_KEYS = ("format", "format_version", "encoding", "top_k", "vocab_size", "temperature", "seq_length",
                 "num_samples", "samples_per_shard", "sample_bytes", "bytes_per_token", "teacher", "tokenizer",
                 "dataset", "token_hash", "alignment")
# Keys only some encodings have (each encoding's own settings: topp's top_p, min_k; sampled's samples, sample_seed);
# absent from the settings (and their hash) of the others, so the caches built before them keep their bytes and hashes.
OPTIONAL_KEYS = setting_keys()
OFFSETS_DTYPE = np.dtype("<u8")


def _keys(meta: dict) -> tuple:
    return SETTINGS_KEYS + tuple(k for k in OPTIONAL_KEYS if k in meta)

def settings_of(meta: dict) -> dict:
    """The settings part of a manifest, settings.json or sidecar "settings" entry."""
    return {k: meta.get(k) for k in _keys(meta)}


def is_finished(path) -> bool:
    """A finished cache: its manifest, written last by the build, is there (verify_cache checks the rest)."""
    return bool(path) and os.path.isfile(os.path.join(path, MANIFEST))


def settings_hash(meta: dict) -> str:
    return config_hash(settings_of(meta))


def field_diff(a: dict, b: dict, a_name: str, b_name: str) -> list[str]:
    """'FIELD: A_NAME has x, B_NAME has y' for every settings field that differs."""
    return [f"{k}: {a_name} has {a.get(k)!r}, {b_name} has {b.get(k)!r}" for k in SETTINGS_KEYS + OPTIONAL_KEYS
            if a.get(k) != b.get(k)]


def shard_name(j: int) -> str:
    return os.path.join(SHARD_DIR, f"{j:06d}.bin")


def sidecar_name(j: int) -> str:
    return os.path.join(SHARD_DIR, f"{j:06d}.json")


def make_settings(*, encoding, vocab_size, temperature, seq_length, num_samples, teacher, tokenizer="",
                  dataset="", samples_per_shard=None) -> dict:
    """The settings of a cache: `encoding` the EncodingOptions it is built with (its name and K resolved)."""
    name, top_k = encoding.name, encoding.top_k
    if name not in ENCODINGS:
        raise CacheError(f"unknown encoding {name!r}; use one of {', '.join(ENCODINGS)}")
    problem = encoding.problem()
    if problem == "needs_samples":
        raise CacheError("encoding 'sampled' stores N draws per position: give samples (--samples, e.g. 16)")
    if problem == "not_sampled":
        raise CacheError(f"samples / sample_seed draw ids from the teacher's distribution, which the encoding "
                         f"{name!r} does not store: use encoding 'sampled' (--encoding sampled), or drop them")
    if encoding.forced_top_k() not in (None, top_k):
        raise CacheError(f"a sampled cache holds at most samples={encoding.get('samples')} ids per position; "
                         f"top_k={top_k} cannot differ (drop --top-k)")
    if encoding.settings_problem():
        raise CacheError(encoding.settings_problem())
    if problem == "needs_top_p":
        raise CacheError("encoding 'topp' keeps the fewest ids holding a mass P per position: give top_p "
                         "(--top-p, e.g. 0.999)")
    if problem == "fixed_k":
        raise CacheError(f"top_p / min_k select a variable number of ids per position, which the encoding "
                         f"{name!r} does not store: use encoding 'topp' (--encoding topp), or drop top_p / min_k")
    problem = temperature_problem(temperature)
    if problem:
        raise CacheError(f"temperature={temperature!r}: the capture temperature {problem} "
                         "(1.0 = the teacher's own distribution)")
    if num_samples < 1:
        raise CacheError("the dataset has no samples; pass a non-empty dataset or --num-samples >= 1")
    try:
        enc = encoding.make(vocab_size, seq_length)
    except ValueError as e:
        raise CacheError(f"{e}") from None
    if samples_per_shard is None:
        samples_per_shard = max(1, min(num_samples, DEFAULT_SHARD_BYTES // enc.sample_bytes))
    if samples_per_shard < 1:
        raise CacheError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    extra = enc.settings_extra(encoding)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "encoding": name, "top_k": int(top_k), **extra,
        "vocab_size": int(vocab_size), "temperature": float(temperature), "seq_length": int(seq_length),
        "num_samples": int(num_samples), "samples_per_shard": int(samples_per_shard),
        "sample_bytes": enc.sample_bytes, "bytes_per_token": enc.bytes_per_token,
        "teacher": teacher, "tokenizer": str(tokenizer), "dataset": str(dataset),
        "token_hash": "blake2b-64 of the sample's input tokens [seq_length] as little-endian int64",
        "alignment": "row t = teacher distribution of token t+1 given tokens[:t+1] (aligned with labels)",
    }


def num_shards(settings: dict) -> int:
    return -(-settings["num_samples"] // settings["samples_per_shard"])


def shard_range(settings: dict, j: int) -> tuple[int, int]:
    first = j * settings["samples_per_shard"]
    return first, min(settings["num_samples"], first + settings["samples_per_shard"])


def settings_diff(old: dict, new: dict) -> list[str]:
    return [f"{k}: cache has {old.get(k)!r}, this build asks for {new.get(k)!r}"
            for k in SETTINGS_KEYS + OPTIONAL_KEYS if old.get(k) != new.get(k)]


def check_format(meta: dict, path) -> None:
    if meta.get("format") != FORMAT:
        raise CacheError(f"{path} is not a megatron-kd top-K cache (format={meta.get('format')!r}); "
                         "point to the directory `megatron-kd cache build --out` wrote")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CacheError(f"{path} has format_version {meta.get('format_version')} (the cache format), this megatron-kd reads "
                         f"version {FORMAT_VERSION}; rebuild the cache with this version or use the matching release")


def offsets_footer(sizes) -> bytes:
    """The end of a variable-size shard: count + 1 uint64 offsets of its samples (0 first, the data size last)."""
    return np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))]).astype(OFFSETS_DTYPE).tobytes()


def offsets_problem(offsets: np.ndarray, file_bytes: int, max_sample: int, min_sample: int) -> str | None:
    """None when a shard's offset table is consistent with its size and the encoding's sample sizes."""
    footer = offsets.size * OFFSETS_DTYPE.itemsize
    sizes = np.diff(offsets.astype(np.int64))
    if offsets[0] != 0 or int(offsets[-1]) + footer != file_bytes:
        return f"its offset table does not span its {file_bytes} bytes"
    if sizes.size and (sizes.min() < min_sample or sizes.max() > max_sample):
        return f"its offset table gives a sample outside [{min_sample}, {max_sample}] bytes"
    return None
