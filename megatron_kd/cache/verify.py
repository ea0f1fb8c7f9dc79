"""verify_cache (checksums, completeness) and inspect_cache (sizes, covered mass, encoding error, read speed)."""
import hashlib
import os
import time

import numpy as np

from . import stats as stats_mod
from .errors import CacheError
from .format import MANIFEST, SAMPLE_INDEX, SAMPLE_INDEX_DTYPE, SETTINGS, num_shards, sidecar_name
from .fsio import read_json
from .hashing import CHECKSUM, file_sha256


def _fix(path, j, name) -> str:
    return (f"delete {os.path.join(path, name)} and {os.path.join(path, sidecar_name(j))}, then rerun the same "
            "`megatron-kd cache build` command: only that shard is recomputed")


def verify_cache(path, *, checksums: bool = True) -> list[str]:
    """Problems found, each naming the file and the fix; [] when the cache is complete and intact."""
    from .reader import load_manifest
    path = os.fspath(path)
    try:
        m = load_manifest(path)
    except CacheError as e:
        return [str(e)]
    problems = []
    if len(m["shards"]) != num_shards(m):
        problems.append(f"{path}: the manifest lists {len(m['shards'])} shards, the settings need {num_shards(m)}; "
                        f"delete {MANIFEST} and rerun the same build command")
    covered = 0
    for s in m["shards"]:
        f = os.path.join(path, s["file"])
        if s["first"] != covered:
            problems.append(f"{path}: shard {s['file']} starts at sample {s['first']}, expected {covered}; "
                            f"delete {MANIFEST} and rerun the same build command")
        covered = s["first"] + s["count"]
        if not os.path.exists(f):
            problems.append(f"shard {s['file']}: missing; {_fix(path, s['shard'], s['file'])}")
        elif os.path.getsize(f) != s["bytes"]:
            problems.append(f"shard {s['file']}: {os.path.getsize(f)} bytes, expected {s['bytes']} (truncated); "
                            + _fix(path, s["shard"], s["file"]))
        elif checksums and file_sha256(f) != s[CHECKSUM]:
            problems.append(f"shard {s['file']}: {CHECKSUM} mismatch (corrupt); {_fix(path, s['shard'], s['file'])}")
    if covered != m["num_samples"]:
        problems.append(f"{path}: shards cover {covered} samples, the manifest says {m['num_samples']}; "
                        f"delete {MANIFEST} and rerun the same build command")
    idx = os.path.join(path, SAMPLE_INDEX)
    if not os.path.exists(idx) or os.path.getsize(idx) != m["num_samples"] * SAMPLE_INDEX_DTYPE.itemsize:
        problems.append(f"{SAMPLE_INDEX}: missing or wrong size; delete it and {MANIFEST}, then rerun the same "
                        "build command (no shard is recomputed)")
    elif checksums:
        with open(idx, "rb") as fh:
            if hashlib.sha256(fh.read()).hexdigest() != m["sample_index"][CHECKSUM]:
                problems.append(f"{SAMPLE_INDEX}: {CHECKSUM} mismatch (corrupt); delete it and {MANIFEST}, then "
                                "rerun the same build command (no shard is recomputed)")
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
