"""Identities: per-sample token hashes, shard checksums, and teacher fingerprints."""
import hashlib
import json
import zlib

import numpy as np

from .. import rules

CHECKSUM = "sha256"


def token_hash(tokens) -> int:
    """64-bit blake2b of the teacher's input tokens as little-endian int64 (what the cache row describes)."""
    if hasattr(tokens, "detach"):
        tokens = tokens.detach().cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(tokens).ravel(), dtype="<i8")
    return int.from_bytes(hashlib.blake2b(arr.tobytes(), digest_size=8).digest(), "little")


def hex64(value: int) -> str:
    return f"{int(value):016x}"


def crc32(buf) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(buf)).cast("B")) & 0xFFFFFFFF


def tokenizer_id(path) -> str:
    """A tokenizer file's identity, as caches, dataset ids and .bin sidecars record it: its sha256's first 16
    hex digits."""
    return rules.file_sha256(path)[:16]


def config_hash(config: dict) -> str:
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
