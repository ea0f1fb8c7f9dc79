"""CacheWriter: lock, settings first, shards committed atomically one by one, manifest last.

One builder per directory: the writer holds an exclusive lock on DIR/build.lock for its lifetime (a second
builder is refused at once). A shard is done when its sidecar records this build's settings hash and its .bin
has the expected size; any other shard is recomputed from its first sample into a fresh temporary file (the
temporary files a killed run left are deleted, never appended to), so a build killed at any moment and restarted
with the same settings ends byte-identical to an uninterrupted one.
"""
import functools
import hashlib
import os
import shutil

import numpy as np

from . import stats as stats_mod
from .encoding import encoding_of, get_encoding
from .errors import CacheError
from .format import (LOCK, MANIFEST, SAMPLE_INDEX, SAMPLE_INDEX_DTYPE, SETTINGS, SHARD_DIR, check_format,
                     num_shards, offsets_footer, settings_diff, settings_hash, settings_of, shard_name, shard_range,
                     sidecar_name)
from .fsio import (commit, fault_point, open_temp, read_json, remove_temp_files, try_lock, write_bytes_atomic,
                   write_json_atomic)
from .hashing import CHECKSUM, crc32, hex64, token_hash


class EncodedSample:
    """One sample ready to append: its encoded bytes and what the sidecar records of it."""
    __slots__ = ("buf", "stats", "token_hash", "crc")

    def __init__(self, buf, stats, token_hash_, crc):
        self.buf, self.stats, self.token_hash, self.crc = buf, stats, token_hash_, crc


def encode_sample(encoding, seq_length: int, ids, logp, tokens, run=None) -> EncodedSample:
    """Encode one sample (ids and log-probs [S, K], tokens [S]) and measure it; touches no file, so the builder
    runs it on worker threads while the teacher computes the next micro-batch.

    run (optional): runs a list of zero-argument calls, maybe in parallel, and returns their results in order
    (e.g. lambda fs: list(pool.map(lambda f: f(), fs))). A fixed-size encoding then encodes and checks blocks of
    positions in parallel (row_chunks); the bytes and statistics are those of the whole-sample path."""
    if tokens.shape != (seq_length,):
        raise CacheError(f"tokens must be [seq_length={seq_length}], got {tokens.shape}")
    chunks = row_chunks(encoding, seq_length) if run is not None else None
    if chunks is None:
        buf = encoding.encode(ids, logp)
        dec_ids, dec_lp = encoding.decode(buf)
        stats = stats_mod.sample_stats(ids, logp, dec_ids, dec_lp, encoding.select)
    else:
        encoding.check_shape(ids, logp)  # the blocks below slice rows: a longer sample must not pass as shorter
        buf = np.zeros(encoding.sample_bytes, dtype=np.uint8)
        run([functools.partial(_encode_rows, encoding, buf, ids, logp, a, b) for a, b in chunks])

        def check(a, b):
            dec_ids, dec_lp = encoding.decode(buf, a, b)
            return stats_mod.row_stats(ids[a:b], logp[a:b], dec_ids, dec_lp)
        parts = run([functools.partial(check, a, b) for a, b in chunks])
        stats = stats_mod.of_rows(np.concatenate([m for m, _ in parts]), np.concatenate([e for _, e in parts]))
    return EncodedSample(buf, stats, token_hash(tokens), crc32(buf))


ROW_BLOCK = 1024  # positions per parallel block (a multiple of 8: every field's bits of a block end on a byte)


def row_chunks(encoding, seq_length: int, block: int | None = None):
    """[(first, stop)] position blocks of a sample that encode independently, or None (one block, or an encoding
    whose sample size depends on its content). Every field of a fixed-size encoding stores a fixed number of bits
    per position, so a block starting at a multiple of 8 positions starts on a byte of each field."""
    block = block or ROW_BLOCK
    if block % 8:
        raise ValueError(f"row block {block} must be a multiple of 8 positions (each field's bits end on a byte)")
    if encoding.variable or seq_length < 2 * block:
        return None
    return [(a, min(seq_length, a + block)) for a in range(0, seq_length, block)]


def _encode_rows(encoding, buf, ids, logp, a, b) -> None:
    """Positions [a, b) encoded as a sample of b - a positions, each field's bytes copied to its place in buf."""
    part = get_encoding(encoding.name, encoding.vocab_size, encoding.k, b - a)
    out = part.encode(ids[a:b], logp[a:b])
    before = get_encoding(encoding.name, encoding.vocab_size, encoding.k, a) if a else None
    for name, size in part.fields.size.items():
        at = encoding.fields.offset[name] + (before.fields.size[name] if before else 0)
        buf[at:at + size] = part.fields.view(out, name)


def _numpy(x):
    return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x)


class ShardWriter:
    """Streams one shard's samples into a fresh temporary file; commit() makes it visible."""

    def __init__(self, writer: "CacheWriter", j: int):
        self.w, self.j = writer, j
        self.first, self.stop = shard_range(writer.settings, j)
        self.path = os.path.join(writer.path, shard_name(j))
        self.f, self.tmp = open_temp(self.path)  # a new file: nothing a killed run left is reused
        # sha256 of the bytes as they are written: the sidecar's checksum without reading the shard back
        self.sha = hashlib.sha256()
        self.hashes, self.crcs, self.stats = [], [], stats_mod.empty_stats()
        self.sizes = []  # each sample's bytes (they differ under a variable-size encoding)

    def add(self, topk_ids, topk_logprobs, tokens) -> None:
        """One or more samples: ids [b, S, K] or [S, K], log-probs the same, tokens [b, S] or [S]."""
        ids, lp, tok = (_numpy(x) for x in (topk_ids, topk_logprobs, tokens))
        if ids.ndim == 2:
            ids, lp, tok = ids[None], lp[None], tok[None]
        self.check_room(len(ids))
        for i in range(len(ids)):
            self.append(encode_sample(self.w.encoding, self.w.settings["seq_length"], ids[i], lp[i], tok[i]))

    def check_room(self, n: int) -> None:
        if len(self.hashes) + n > self.stop - self.first:
            raise CacheError(f"shard {self.j} holds {self.stop - self.first} samples; got more")

    def append(self, e: EncodedSample) -> None:
        """The next sample of the shard, encoded (in sample order)."""
        self.check_room(1)
        self.stats = stats_mod.merge(self.stats, e.stats)
        self._write(np.ascontiguousarray(e.buf, dtype=np.uint8))
        self.sizes.append(e.buf.size)
        self.hashes.append(e.token_hash)
        self.crcs.append(e.crc)
        fault_point("sample")

    def _write(self, data) -> None:
        self.f.write(data)
        self.sha.update(data)

    def commit(self) -> None:
        count = self.stop - self.first
        if len(self.hashes) != count:
            raise CacheError(f"shard {self.j} got {len(self.hashes)} samples, needs {count}")
        nbytes = count * self.w.settings["sample_bytes"]
        if self.w.encoding.variable:  # the samples' offsets close the shard: sample i is found without a scan
            footer = offsets_footer(self.sizes)
            self._write(footer)
            nbytes = sum(self.sizes) + len(footer)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        fault_point("shard:written")
        commit(self.tmp, self.path)
        fault_point("shard:committed")
        side = {"shard": self.j, "first": self.first, "count": count, "file": shard_name(self.j),
                "bytes": nbytes, CHECKSUM: self.sha.hexdigest(),
                "settings_hash": self.w.settings_hash, "settings": self.w.settings,
                "token_hashes": [hex64(h) for h in self.hashes], "crc32": self.crcs, "stats": self.stats}
        write_json_atomic(os.path.join(self.w.path, sidecar_name(self.j)), side, "sidecar")

    def abort(self) -> None:
        if not self.f.closed:
            self.f.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


class CacheWriter:
    """lock=True (the builder; global rank 0 of a distributed build): take DIR/build.lock, compare or write the
    settings, delete leftovers. lock=False: another rank of a build whose rank 0 holds the lock."""

    def __init__(self, path, settings: dict, *, overwrite: bool = False, lock: bool = True,
                 settings_fix: str | None = None):
        """settings_fix: what the caller's user does when `path` holds a cache of other settings (default: the
        `cache build` flags)."""
        self.path = os.fspath(path)
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise CacheError(f"{self.path} is a file, not a cache directory; give a directory (made when missing)")
        if lock and os.path.isdir(self.path):
            names = sorted(os.listdir(self.path))
            if names and not set(names) & {SETTINGS, MANIFEST, SHARD_DIR, LOCK}:
                raise CacheError(f"{self.path} holds files and no cache ({', '.join(names[:3])}"
                                 f"{', ...' if len(names) > 3 else ''}), and a build writes its shards there and "
                                 "deletes what looks like its leftovers; give an empty or new directory")
        self.settings, self.settings_fix = settings, settings_fix
        self.settings_hash = settings_hash(settings)
        self.encoding = encoding_of(settings)
        self._lock_fd = None
        os.makedirs(os.path.join(self.path, SHARD_DIR), exist_ok=True)
        if not lock:
            return
        self._lock()
        try:
            self._prepare(overwrite)
        except BaseException:
            self.close()
            raise

    def _lock(self) -> None:
        fd = try_lock(os.path.join(self.path, LOCK))
        if fd is None:
            raise CacheError(f"another cache build is writing to {self.path} (it holds {LOCK}); wait for it to "
                             "finish, or build into another --out directory")
        self._lock_fd = fd
        fault_point("lock")

    def close(self) -> None:
        """Release the directory's lock (also on garbage collection and process exit)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __del__(self):
        self.close()

    def _prepare(self, overwrite: bool) -> None:
        for d in (self.path, os.path.join(self.path, SHARD_DIR)):
            remove_temp_files(d)  # we hold the lock: whoever wrote them is gone
        fault_point("temp_removed")
        diffs = [(name, d) for name, meta in self._existing() if (d := settings_diff(meta, self.settings))]
        if diffs:
            if not overwrite:
                finished = os.path.exists(os.path.join(self.path, MANIFEST))
                what = "a finished cache" if finished else "a partial build"
                if self.settings_fix:
                    raise CacheError(f"{self.path} holds {what} built with different settings "
                                     f"({'; '.join(diffs[0][1])}); {self.settings_fix}")
                raise CacheError(
                    f"{self.path} holds {what} built with different settings:\n  " + "\n  ".join(diffs[0][1])
                    + "\nWrite to a new directory (--out), rerun with the original settings to "
                    + ("use it" if finished else "resume it") + ", or pass --overwrite (overwrite=True) to delete it.")
            self._remove_all()
        if not os.path.exists(os.path.join(self.path, SETTINGS)):
            write_json_atomic(os.path.join(self.path, SETTINGS), self.settings, "settings")
        if self.pending_shards() and os.path.exists(os.path.join(self.path, MANIFEST)):
            os.remove(os.path.join(self.path, MANIFEST))  # shards were deleted for a rebuild: not finished now
            fault_point("manifest:removed")

    def _existing(self) -> list:
        """[(file name, its settings)] for manifest.json and settings.json where present."""
        out = []
        for name in (MANIFEST, SETTINGS):
            p = os.path.join(self.path, name)
            if os.path.exists(p):
                try:
                    meta = read_json(p)
                except ValueError:
                    fix = ("delete it and rerun the same build command (finished shards are kept)" if name == MANIFEST
                           else "restore it, or pass --overwrite (overwrite=True) to start this directory over")
                    raise CacheError(f"{p} is unreadable; {fix}") from None
                if not isinstance(meta, dict):
                    raise CacheError(f"{p} is not a JSON object; delete it or pass --overwrite (overwrite=True)")
                check_format(meta, p)
                out.append((name, settings_of(meta)))
        return out

    def _remove_all(self) -> None:
        """--overwrite: the shards first (sidecars before data), then the index and manifest, settings last."""
        shards = os.path.join(self.path, SHARD_DIR)
        names = sorted(os.listdir(shards))
        for n in [n for n in names if n.endswith(".json")] + [n for n in names if not n.endswith(".json")]:
            p = os.path.join(shards, n)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        fault_point("overwrite:shards_removed")
        for name in (MANIFEST, SAMPLE_INDEX, SETTINGS):
            p = os.path.join(self.path, name)
            if os.path.exists(p):
                os.remove(p)
        fault_point("overwrite:removed")

    @property
    def num_shards(self) -> int:
        return num_shards(self.settings)

    def shard_range(self, j: int) -> tuple[int, int]:
        return shard_range(self.settings, j)

    def sidecar(self, j: int):
        """Shard j's sidecar if it is done with this build's settings, else None."""
        first, stop = self.shard_range(j)
        data, side = (os.path.join(self.path, f) for f in (shard_name(j), sidecar_name(j)))
        variable = self.encoding.variable  # its shard's size is in the sidecar, not in the settings
        if not (os.path.exists(side) and os.path.exists(data)
                and (variable or os.path.getsize(data) == (stop - first) * self.settings["sample_bytes"])):
            return None
        try:
            meta = read_json(side)
        except ValueError:
            return None  # unreadable: recomputed
        if not isinstance(meta, dict) or meta.get("settings_hash") != self.settings_hash:
            return None  # built with other settings (another teacher, data, K, ...): never adopted
        if variable and os.path.getsize(data) != meta.get("bytes"):
            return None
        if (meta.get("first"), meta.get("count")) != (first, stop - first):
            return None
        return meta

    def shard_done(self, j: int) -> bool:
        return self.sidecar(j) is not None

    def pending_shards(self) -> list[int]:
        return [j for j in range(self.num_shards) if not self.shard_done(j)]

    def begin_shard(self, j: int) -> ShardWriter:
        side = os.path.join(self.path, sidecar_name(j))
        if os.path.exists(side):
            os.remove(side)  # a stale sidecar or one without its data: the shard is redone
            fault_point("sidecar:removed")
        return ShardWriter(self, j)

    def check_tokens(self, token_hash_of) -> None:
        """Resume: every done shard's recorded token hashes against token_hash_of(i) of the dataset now given."""
        for j in range(self.num_shards):
            side = self.sidecar(j)
            if side is None:
                continue
            for r, want in enumerate(side["token_hashes"]):
                i = side["first"] + r
                got = hex64(token_hash_of(i))
                if got != want:
                    raise CacheError(
                        f"{self.path}: sample {i} ({sidecar_name(j)}) was built from other tokens (hash {want}, the "
                        f"dataset now gives {got}): this is not the dataset the cache was started with. Rerun with "
                        "the original data, or build into another --out directory (or pass --overwrite)")

    def finalize(self) -> dict:
        """samples.idx, then manifest.json. Call once every shard is done."""
        missing = self.pending_shards()
        if missing:
            raise CacheError(f"cannot finalize {self.path}: shards {missing[:10]} are not done; "
                             "rerun the same build command to compute them")
        index = np.zeros(self.settings["num_samples"], dtype=SAMPLE_INDEX_DTYPE)
        shards, total = [], stats_mod.empty_stats()
        for j in range(self.num_shards):
            side = read_json(os.path.join(self.path, sidecar_name(j)))
            a, b = side["first"], side["first"] + side["count"]
            index["token_hash"][a:b] = [int(h, 16) for h in side["token_hashes"]]
            index["crc32"][a:b] = side["crc32"]
            shards.append({k: side[k] for k in ("shard", "first", "count", "file", "bytes", CHECKSUM,
                                                "settings_hash")})
            total = stats_mod.merge(total, side["stats"])
        idx_bytes = index.tobytes()
        write_bytes_atomic(os.path.join(self.path, SAMPLE_INDEX), idx_bytes, "index")
        manifest = dict(self.settings)
        manifest.update(shards=shards, sample_index={"file": SAMPLE_INDEX, "dtype": str(SAMPLE_INDEX_DTYPE.descr),
                                                     CHECKSUM: hashlib.sha256(idx_bytes).hexdigest()},
                        stats=total, checksum=CHECKSUM, settings_hash=self.settings_hash)
        write_json_atomic(os.path.join(self.path, MANIFEST), manifest, "manifest")
        return manifest
