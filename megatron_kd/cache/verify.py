"""verify_cache (checksums, completeness) and inspect_cache (sizes, covered mass, encoding error, read speed)."""
import os
import time

import numpy as np

from . import stats as stats_mod
from .checks import manifest_problems, shard_fix
from .errors import CacheError
from .format import (MANIFEST, SAMPLE_INDEX, SAMPLE_INDEX_DTYPE, SETTINGS, field_diff, num_shards, settings_of,
                     sidecar_name)
from .fsio import read_json
from .hashing import CHECKSUM, file_sha256


QUICK_CHECKS = ("every manifest field against settings.json and the settings hash its shards were built with, "
                "the encoding's byte sizes, shard count, ranges and file sizes, samples.idx size and sha256")
FULL_CHECKS = QUICK_CHECKS + ("; and every shard's sha256, every sidecar's settings, checksum, token hashes and "
                              "crc32s against the manifest and samples.idx")


def verify_cache(path, *, checksums: bool = True) -> list[str]:
    """Problems found, each naming the file or field and the fix; [] when the cache is complete and intact.
    checksums=False (`verify --quick`) checks QUICK_CHECKS only: a flipped byte inside a shard passes it."""
    from .reader import load_manifest
    path = os.fspath(path)
    try:
        m = load_manifest(path)
    except CacheError as e:
        return [str(e)]
    problems = manifest_problems(path, m)
    if problems or not checksums:
        return problems
    index = np.fromfile(os.path.join(path, SAMPLE_INDEX), dtype=SAMPLE_INDEX_DTYPE)
    for j, s in enumerate(m["shards"]):
        f = os.path.join(path, s["file"])
        if file_sha256(f) != s[CHECKSUM]:
            problems.append(f"{path}: shard {s['file']} fails its {CHECKSUM} check (corrupt); {shard_fix(path, j)}")
        sp = os.path.join(path, sidecar_name(j))
        try:
            side = read_json(sp)
            if not isinstance(side, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            problems.append(f"{path}: sidecar {sidecar_name(j)} is missing or unreadable ({e}); the cache still "
                            f"reads, but a resumed build would redo shard {j}; {shard_fix(path, j)}")
            continue
        d = field_diff(m, settings_of(side.get("settings") or {}), MANIFEST, sidecar_name(j))
        if d:
            problems.append(f"{path}: shard {j} was built with other settings: " + "; ".join(d) + "; a field was "
                            f"edited: restore it, or rebuild the cache (`megatron-kd cache build --overwrite`)")
        a, b = s["first"], s["first"] + s["count"]
        for key, want in ((CHECKSUM, s[CHECKSUM]), ("settings_hash", s["settings_hash"])):
            if side.get(key) != want:
                problems.append(f"{path}: sidecar {sidecar_name(j)} field {key} = {side.get(key)!r}, the manifest says "
                                f"{want!r}; {shard_fix(path, j)}")
        hashes = [f"{int(h):016x}" for h in index["token_hash"][a:b]]
        if side.get("token_hashes") != hashes or side.get("crc32") != [int(c) for c in index["crc32"][a:b]]:
            problems.append(f"{path}: sidecar {sidecar_name(j)}'s token hashes or crc32s differ from {SAMPLE_INDEX} "
                            f"(samples {a}..{b - 1}); {shard_fix(path, j)}")
    return problems


def _progress(path) -> dict:
    settings = read_json(os.path.join(path, SETTINGS))
    total = num_shards(settings)
    done = sum(os.path.exists(os.path.join(path, sidecar_name(j))) for j in range(total))
    return {"path": path, "complete": False, "shards_done": done, "shards_total": total,
            "encoding": settings["encoding"], "top_k": settings["top_k"], "vocab_size": settings["vocab_size"],
            "num_samples": settings["num_samples"], "bytes_per_token": settings["bytes_per_token"]}


def inspect_cache(path, *, max_samples: int = 64) -> dict:
    """Summary of a cache. Covered mass and kl_error were measured at build time on every position against the
    fp32 top-K; read speed is timed here on up to max_samples samples."""
    from .reader import CacheReader
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, MANIFEST)) and os.path.exists(os.path.join(path, SETTINGS)):
        return _progress(path)
    r = CacheReader(path)
    m = r.manifest
    total_bytes = sum(s["bytes"] for s in m["shards"])
    out = {"path": path, "complete": True, "num_samples": len(r), "seq_length": r.seq_length, "top_k": r.top_k,
           "vocab_size": r.vocab_size, "temperature": r.temperature, "encoding": r.encoding,
           "bytes_per_token": m["bytes_per_token"], "bytes_per_entry": m["bytes_per_token"] / r.top_k,
           "total_bytes": total_bytes, "shards": len(m["shards"]), "teacher": m["teacher"],
           "tokenizer": m["tokenizer"], "dataset": m["dataset"]}
    out.update(stats_mod.summary(m["stats"]))
    picks = np.unique(np.linspace(0, len(r) - 1, num=min(max_samples, len(r))).astype(np.int64))
    t0 = time.perf_counter()
    for i in picks:
        r[int(i)]
    dt = max(1e-9, time.perf_counter() - t0)
    out["read_samples_per_s"] = len(picks) / dt
    out["read_tokens_per_s"] = len(picks) * r.seq_length / dt
    return out
