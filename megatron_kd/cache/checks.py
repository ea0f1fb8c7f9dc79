"""What a finished cache must satisfy without reading its shards: the manifest against settings.json, the
settings hash its shards were built with, the encoding's byte sizes, the shard ranges and file sizes, and
samples.idx (size and checksum). The reader raises the first problem at open; verify reports them all."""
import hashlib
import os

from ..rules import temperature_problem
from .encoding import encoding_of
from .format import (MANIFEST, OFFSETS_DTYPE, SAMPLE_INDEX, SAMPLE_INDEX_DTYPE, SETTINGS, SETTINGS_KEYS, field_diff,
                     num_shards, settings_hash, settings_of, shard_name, shard_range, sidecar_name)
from .fsio import read_json
from .hashing import CHECKSUM

_INT_FIELDS = ("top_k", "vocab_size", "seq_length", "num_samples", "samples_per_shard", "sample_bytes")


def rebuild_hint(path) -> str:
    return (f"rerun the command that built {path} (`megatron-kd cache build --out {path} ...`, or the training "
            "command with kd.build_cache=true): it keeps the intact shards and recomputes only what you deleted")


def shard_fix(path, j) -> str:
    return (f"delete {os.path.join(path, shard_name(j))} and {os.path.join(path, sidecar_name(j))}, then "
            + rebuild_hint(path))


def _rebuild_manifest(path) -> str:
    return f"delete {os.path.join(path, MANIFEST)} and {os.path.join(path, SAMPLE_INDEX)}, then " + rebuild_hint(path)


def manifest_problems(path, m: dict, *, first_only: bool = False) -> list[str]:
    """Problems of the manifest m of the cache at path, each naming the field or file and the fix."""
    out = []
    for msg in _problems(path, m):
        out.append(f"{path}: {msg}")
        if first_only:
            break
    return out


def _problems(path, m):
    """Every problem, in check order; the checks run lazily, so first_only reads no file past the first problem.
    A stage returns True when its problems leave the later stages nothing sound to check."""
    for stage in (_field_problems, _settings_problems, _hash_problems, _encoding_problems, _shard_problems,
                  _index_problems):
        if (yield from stage(path, m)):
            return


def _field_problems(path, m):
    """1. every settings field present and of the right type."""
    missing = [k for k in SETTINGS_KEYS + ("shards", "sample_index", "settings_hash") if k not in m]
    if missing:
        yield (f"{MANIFEST} lacks the field(s) {', '.join(missing)} (edited, or written by another version); "
               + _rebuild_manifest(path))
        return True
    found = False
    for k in _INT_FIELDS:
        if type(m[k]) is not int or m[k] < 1:
            found = True
            yield f"{MANIFEST} field {k} = {m[k]!r} is not a positive integer; " + _rebuild_manifest(path)
    t = m["temperature"]
    if temperature_problem(t):
        found = True
        yield f"{MANIFEST} field temperature = {t!r} {temperature_problem(t)}; " + _rebuild_manifest(path)
    return found


def _settings_problems(path, m):
    """2. the manifest against settings.json."""
    sp = os.path.join(path, SETTINGS)
    try:
        settings = read_json(sp)
    except FileNotFoundError:
        yield (f"{SETTINGS} is missing (it records what the build was asked for); restore it, or delete "
               f"{MANIFEST} and {rebuild_hint(path)}")
        return
    except ValueError:
        yield f"{SETTINGS} is not valid JSON; restore it, or " + rebuild_hint(path)
        return
    if not isinstance(settings, dict):
        settings = {}
    for d in field_diff(m, settings, MANIFEST, SETTINGS):
        yield (f"manifest field {d} (one of them was edited); restore it, or rebuild the cache "
               f"(`megatron-kd cache build --overwrite --out {path} ...`)")


def _hash_problems(path, m):
    """3. the settings the shards were built with."""
    h = settings_hash(m)
    if m["settings_hash"] != h:
        yield (f"{MANIFEST}'s settings hash to {h}, its field settings_hash says {m['settings_hash']!r}: a field of "
               f"{MANIFEST} was edited; {_named_from_sidecar(path, m)}restore it or rebuild the cache "
               f"(`megatron-kd cache build --overwrite --out {path} ...`)")


def _encoding_problems(path, m):
    """4. the encoding's byte sizes."""
    try:
        enc = encoding_of(m)
    except (ValueError, TypeError) as e:
        yield (f"{MANIFEST} fields encoding/top_k/vocab_size/seq_length/top_p/min_k do not describe an encoding ({e}); "
               + _rebuild_manifest(path))
        return True
    if enc.sample_bytes != m["sample_bytes"]:
        yield (f"{MANIFEST} field sample_bytes = {m['sample_bytes']}, but encoding {m['encoding']!r} at K={m['top_k']}, "
               f"V={m['vocab_size']}, S={m['seq_length']} needs {enc.sample_bytes}; " + _rebuild_manifest(path))
    if m["bytes_per_token"] != enc.bytes_per_token:
        yield (f"{MANIFEST} field bytes_per_token = {m['bytes_per_token']!r}, the encoding gives "
               f"{enc.bytes_per_token}; " + _rebuild_manifest(path))


def _shard_problems(path, m):
    """5. shards: count, ranges, names, hashes, sizes on disk."""
    shards = m["shards"]
    if not isinstance(shards, list) or len(shards) != num_shards(m):
        n = len(shards) if isinstance(shards, list) else shards
        yield (f"{MANIFEST} lists {n} shards, num_samples={m['num_samples']} / samples_per_shard="
               f"{m['samples_per_shard']} needs {num_shards(m)}; " + _rebuild_manifest(path))
        return True
    h = settings_hash(m)
    variable = encoding_of(m).variable
    for j, s in enumerate(shards):
        problem = _shard_problem(path, m, h, j, s, variable)
        if problem:
            yield problem


def _shard_problem(path, m, h, j, s, variable=False) -> str | None:
    """Shard entry j's first problem: an entry field, then the file's presence and size. A variable-size
    encoding's shard size is recorded, not implied: it must lie between count smallest and count largest samples
    plus the offset table."""
    first, stop = shard_range(m, j)
    want = {"shard": j, "first": first, "count": stop - first, "file": shard_name(j),
            "bytes": (stop - first) * m["sample_bytes"], "settings_hash": h}
    if not isinstance(s, dict):
        s = {}
    if variable:
        enc, count = encoding_of(m), stop - first
        table = (count + 1) * OFFSETS_DTYPE.itemsize
        lo, hi = count * enc.min_bytes + table, count * enc.max_bytes + table
        if type(s.get("bytes")) is int and lo <= s["bytes"] <= hi:
            want["bytes"] = s["bytes"]
        else:
            return (f"{MANIFEST} shard entry {j} field bytes = {s.get('bytes')!r}, expected an integer in "
                    f"[{lo}, {hi}]; " + _rebuild_manifest(path))
    wrong = [k for k, v in want.items() if s.get(k) != v]
    if wrong:
        k = wrong[0]
        return (f"{MANIFEST} shard entry {j} field {k} = {s.get(k)!r}, expected {want[k]!r}"
                + (" (the shard was built with other settings)" if k == "settings_hash" else "")
                + "; " + _rebuild_manifest(path))
    f = os.path.join(path, s["file"])
    if not os.path.exists(f):
        return f"shard {s['file']} is missing; {shard_fix(path, j)}"
    size = os.path.getsize(f)
    if size != s["bytes"]:
        what = "truncated" if size < s["bytes"] else "too long: overwritten or appended to"
        return f"shard {s['file']} has {size} bytes, expected {s['bytes']} ({what}); {shard_fix(path, j)}"
    return None


def _index_problems(path, m):
    """6. samples.idx: size and checksum (16 bytes per sample: cheap)."""
    ip = os.path.join(path, SAMPLE_INDEX)
    want_bytes = m["num_samples"] * SAMPLE_INDEX_DTYPE.itemsize
    if not os.path.exists(ip) or os.path.getsize(ip) != want_bytes:
        size = os.path.getsize(ip) if os.path.exists(ip) else None
        yield (f"{SAMPLE_INDEX} is {'missing' if size is None else f'{size} bytes'}, expected {want_bytes}; "
               + _rebuild_manifest(path) + " (no shard is recomputed)")
        return
    with open(ip, "rb") as fh:
        got = hashlib.sha256(fh.read()).hexdigest()
    want = m["sample_index"].get(CHECKSUM) if isinstance(m["sample_index"], dict) else None
    if got != want:
        yield (f"{SAMPLE_INDEX} fails its {CHECKSUM} check (corrupt, or the manifest's sample_index was edited); "
               + _rebuild_manifest(path) + " (no shard is recomputed)")


def _named_from_sidecar(path, m) -> str:
    """'FIELD: ...; ' naming the settings fields that differ from shard 0's sidecar, or ''."""
    try:
        side = read_json(os.path.join(path, sidecar_name(0)))
        d = field_diff(m, settings_of(side["settings"]), MANIFEST, f"the shards (from {sidecar_name(0)})")
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return ("the field(s) " + "; ".join(d) + "; ") if d else ""
