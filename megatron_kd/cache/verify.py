"""verify_cache (checksums, completeness) and inspect_cache (sizes, covered mass, encoding error, read speed)."""
import os
import time

import numpy as np

from . import stats as stats_mod
from .checks import manifest_problems, shard_fix
from .encoding import encoding_of
from .errors import CacheError
from .format import (MANIFEST, SAMPLE_INDEX, SAMPLE_INDEX_DTYPE, SETTINGS, field_diff, num_shards, settings_of,
                     sidecar_name)
from .fsio import read_json
from ..rules import file_sha256
from .hashing import CHECKSUM


QUICK_CHECKS = ("every manifest field against settings.json and the settings hash its shards were built with, "
                "the encoding's byte sizes, shard count, ranges and file sizes, samples.idx size and sha256")
FULL_CHECKS = QUICK_CHECKS + ("; and every shard's sha256, every sidecar's settings, checksum, token hashes and "
                              "crc32s against the manifest and samples.idx")
VARIABLE_CHECKS = ("; and (variable-size encoding) every shard's offset table and every sample's per-position "
                   "counts against the ids and codes stored for them")


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
    if encoding_of(m).variable:
        problems += _structure_problems(path)
    return problems


def _structure_problems(path) -> list[str]:
    """Decode every sample of a variable-size cache: a count that disagrees with its stored ids (which a checksum
    taken after the count was written cannot see) fails here, naming sample and shard."""
    from .reader import CacheReader
    r = CacheReader(path, verify_reads=False)
    problems = []
    for j, s in enumerate(r.manifest["shards"]):
        try:
            r.shard_offsets(j)
            for i in range(s["first"], s["first"] + s["count"]):
                r.read(i)
        except CacheError as e:
            problems.append(str(e))
    return problems


def _progress(path) -> dict:
    settings = read_json(os.path.join(path, SETTINGS))
    total = num_shards(settings)
    done = sum(os.path.exists(os.path.join(path, sidecar_name(j))) for j in range(total))
    return {"path": path, "complete": False, "shards_done": done, "shards_total": total,
            "encoding": settings["encoding"], "top_k": settings["top_k"], "vocab_size": settings["vocab_size"],
            "num_samples": settings["num_samples"], "bytes_per_token": settings["bytes_per_token"]}


def inspect_cache(path, *, max_samples: int = 64, top_p=(), min_k: int = 1) -> dict:
    """Summary of a cache. Covered mass and kl_error were measured at build time on every position against the
    fp32 top-K; read speed is timed here on up to max_samples samples. top_p: values of P to preview on those
    samples (what a `--top-p P` build of the same teacher would keep and cost; see top_p_preview)."""
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
    if encoding_of(m).variable:  # the settings hold the largest sample, the shards what was written
        out.update(bytes_per_token_max=m["bytes_per_token"], bytes_per_token=total_bytes / (len(r) * r.seq_length))
        out.update({k: m[k] for k in ("top_p", "min_k", "samples", "sample_seed") if k in m})
        out["bytes_per_entry"] = out["bytes_per_token"] / r.top_k
    out.update(stats_mod.summary(m["stats"]))
    picks = np.unique(np.linspace(0, len(r) - 1, num=min(max_samples, len(r))).astype(np.int64))
    t0 = time.perf_counter()
    for i in picks:
        r[int(i)]
    dt = max(1e-9, time.perf_counter() - t0)
    out["read_samples_per_s"] = len(picks) / dt
    out["read_tokens_per_s"] = len(picks) * r.seq_length / dt
    if top_p:
        out["top_p_preview"] = top_p_preview(r, picks, top_p, min_k)
    return out


def top_p_preview(reader, samples, top_ps, min_k: int = 1) -> dict:
    """On the given samples: the teacher statistics that predict how many ids top-P keeps (mean top-1 probability,
    mean entropy of the top-K entries in nats, mean top-K mass) and, per P, the mean and quantiles of the kept
    count, the dropped mass and the bytes/token of a topp cache (exact sizes, the shard offset table included).
    Read from this cache's entries, so a top-P cache previews only P at or above its own."""
    from .encoding.topp import TopPEncoding
    from .format import OFFSETS_DTYPE
    from .topp import canonical_order, top_p_counts
    rows = [reader.read(int(i)) for i in samples]
    ids = np.concatenate([x["topk_ids"] for x in rows])
    lp = np.concatenate([x["topk_logprobs"] for x in rows])
    ids, lp = canonical_order(ids, lp)
    p = np.where(ids >= 0, np.exp(lp.astype(np.float64)), 0.0)
    mass = p.sum(axis=1)
    ent = -(p * np.where(p > 0, np.log(np.where(p > 0, p, 1.0)), 0.0)).sum(axis=1)
    out = {"positions": int(len(ids)), "top1_prob_mean": float(p[:, 0].mean()), "topk_entropy_mean": float(ent.mean()),
           "topk_mass_mean": float(mass.mean()), "per_top_p": {}}
    for P in top_ps:
        enc = TopPEncoding(reader.vocab_size, reader.top_k, reader.seq_length, P, min_k)
        counts = top_p_counts(lp, P, min_k)
        kept = np.where(np.arange(ids.shape[1]) < counts[:, None], p, 0.0).sum(axis=1)
        nbytes = sum(enc.size_of(c) for c in counts.reshape(len(rows), -1)) + len(rows) * OFFSETS_DTYPE.itemsize
        hist = np.bincount(counts - 1, minlength=reader.top_k).tolist()
        out["per_top_p"][str(P)] = {
            "kept_k_mean": float(counts.mean()),
            "kept_k_quantiles": {f"p{int(q * 100)}": stats_mod.kept_quantile(hist, q) for q in (0.1, 0.5, 0.9, 0.99)},
            "dropped_mass_mean": float((mass - kept).mean()), "bytes_per_token": nbytes / counts.size}
    return out
