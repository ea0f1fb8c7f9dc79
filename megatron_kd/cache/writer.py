"""CacheWriter: settings first, shards committed atomically one by one, manifest last.

A shard is done when its sidecar exists and its .bin has the expected size. A restart recomputes every shard
that is not done from its first sample (its temporary file is truncated), so a build killed at any moment and
restarted with the same settings ends byte-identical to an uninterrupted one.
"""
import os
import shutil

import numpy as np

from . import stats as stats_mod
from .encoding import get_encoding
from .errors import CacheError
from .format import (MANIFEST, SAMPLE_INDEX, SAMPLE_INDEX_DTYPE, SETTINGS, SHARD_DIR, check_format, num_shards,
                     shard_name, shard_range, settings_diff, sidecar_name)
from .fsio import commit, read_json, write_bytes_atomic, write_json_atomic
from .hashing import CHECKSUM, crc32, file_sha256, hex64, token_hash

# Tests set MEGATRON_KD_CACHE_KILL_AT=<event>:<n> to SIGKILL the build at the n-th event (1-based):
# "sample" (a sample written to a shard's temporary file), "shard_data" (a .bin committed, its sidecar not yet),
# "shard" (a shard fully committed), "finalize" (samples.idx written, manifest not yet).
_kill_counts: dict = {}


def _fault_point(event: str) -> None:
    spec = os.environ.get("MEGATRON_KD_CACHE_KILL_AT")
    if not spec:
        return
    name, _, n = spec.partition(":")
    if name == event:
        _kill_counts[event] = _kill_counts.get(event, 0) + 1
        if _kill_counts[event] == int(n or 1):
            import signal
            os.kill(os.getpid(), signal.SIGKILL)


class ShardWriter:
    """Streams one shard's samples into its temporary file; commit() makes it visible."""

    def __init__(self, writer: "CacheWriter", j: int):
        self.w, self.j = writer, j
        self.first, self.stop = shard_range(writer.settings, j)
        self.path = os.path.join(writer.path, shard_name(j))
        self.tmp = self.path + ".tmp"
        self.f = open(self.tmp, "wb")  # truncates what a killed run left behind
        self.hashes, self.crcs, self.stats = [], [], stats_mod.empty_stats()

    def add(self, topk_ids, topk_logprobs, tokens) -> None:
        """One or more samples: ids [b, S, K] or [S, K], log-probs the same, tokens [b, S] or [S]."""
        ids, lp, tok = (np.asarray(x.detach().cpu() if hasattr(x, "detach") else x)
                        for x in (topk_ids, topk_logprobs, tokens))
        if ids.ndim == 2:
            ids, lp, tok = ids[None], lp[None], tok[None]
        if len(self.hashes) + len(ids) > self.stop - self.first:
            raise CacheError(f"shard {self.j} holds {self.stop - self.first} samples; got more")
        enc = self.w.encoding
        for i in range(len(ids)):
            buf = enc.encode(ids[i], lp[i])
            dec_ids, dec_lp = enc.decode(buf)
            self.stats = stats_mod.merge(self.stats, stats_mod.sample_stats(ids[i], lp[i], dec_ids, dec_lp))
            if tok[i].shape != (self.w.settings["seq_length"],):
                raise CacheError(f"tokens must be [seq_length={self.w.settings['seq_length']}], got {tok[i].shape}")
            self.f.write(buf.tobytes())
            self.hashes.append(token_hash(tok[i]))
            self.crcs.append(crc32(buf))
            _fault_point("sample")

    def commit(self) -> None:
        count = self.stop - self.first
        if len(self.hashes) != count:
            raise CacheError(f"shard {self.j} got {len(self.hashes)} samples, needs {count}")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        commit(self.tmp, self.path)
        _fault_point("shard_data")
        side = {"shard": self.j, "first": self.first, "count": count, "file": shard_name(self.j),
                "bytes": count * self.w.settings["sample_bytes"], CHECKSUM: file_sha256(self.path),
                "token_hashes": [hex64(h) for h in self.hashes], "crc32": self.crcs, "stats": self.stats}
        write_json_atomic(os.path.join(self.w.path, sidecar_name(self.j)), side)
        _fault_point("shard")

    def abort(self) -> None:
        if not self.f.closed:
            self.f.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


class CacheWriter:
    def __init__(self, path, settings: dict, *, overwrite: bool = False):
        self.path = os.fspath(path)
        self.settings = settings
        self.encoding = get_encoding(settings["encoding"], settings["vocab_size"], settings["top_k"],
                                     settings["seq_length"])
        os.makedirs(os.path.join(self.path, SHARD_DIR), exist_ok=True)
        existing = self._existing_settings()
        if existing is not None and settings_diff(existing, settings):
            if not overwrite:
                finished = os.path.exists(os.path.join(self.path, MANIFEST))
                what = "a finished cache" if finished else "a partial build"
                raise CacheError(
                    f"{self.path} holds {what} built with different settings:\n  "
                    + "\n  ".join(settings_diff(existing, settings))
                    + "\nWrite to a new directory (--out), rerun with the original settings to "
                    + ("use it" if finished else "resume it") + ", or pass --overwrite (overwrite=True) to delete it.")
            self._remove_all()
            existing = None
        if existing is None:
            write_json_atomic(os.path.join(self.path, SETTINGS), settings)
        if self.pending_shards() and os.path.exists(os.path.join(self.path, MANIFEST)):
            os.remove(os.path.join(self.path, MANIFEST))  # shards were deleted for a rebuild: not finished now

    def _existing_settings(self):
        for name in (MANIFEST, SETTINGS):
            p = os.path.join(self.path, name)
            if os.path.exists(p):
                try:
                    meta = read_json(p)
                except ValueError:
                    fix = ("delete it and rerun the same build command (finished shards are kept)" if name == MANIFEST
                           else "restore it, or pass --overwrite (overwrite=True) to start this directory over")
                    raise CacheError(f"{p} is unreadable; {fix}") from None
                check_format(meta, p)
                return {k: meta.get(k) for k in self.settings}
        return None

    def _remove_all(self) -> None:
        for name in (MANIFEST, SAMPLE_INDEX, SETTINGS):
            p = os.path.join(self.path, name)
            if os.path.exists(p):
                os.remove(p)
        shutil.rmtree(os.path.join(self.path, SHARD_DIR), ignore_errors=True)
        os.makedirs(os.path.join(self.path, SHARD_DIR), exist_ok=True)

    @property
    def num_shards(self) -> int:
        return num_shards(self.settings)

    def shard_range(self, j: int) -> tuple[int, int]:
        return shard_range(self.settings, j)

    def shard_done(self, j: int) -> bool:
        first, stop = self.shard_range(j)
        data, side = (os.path.join(self.path, f) for f in (shard_name(j), sidecar_name(j)))
        return (os.path.exists(side) and os.path.exists(data)
                and os.path.getsize(data) == (stop - first) * self.settings["sample_bytes"])

    def pending_shards(self) -> list[int]:
        return [j for j in range(self.num_shards) if not self.shard_done(j)]

    def begin_shard(self, j: int) -> ShardWriter:
        side = os.path.join(self.path, sidecar_name(j))
        if os.path.exists(side):
            os.remove(side)  # a sidecar without its data: the shard is redone
        return ShardWriter(self, j)

    def write_shard(self, j: int, topk_ids, topk_logprobs, tokens) -> None:
        sw = self.begin_shard(j)
        try:
            sw.add(topk_ids, topk_logprobs, tokens)
            sw.commit()
        except BaseException:
            sw.abort()
            raise

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
            shards.append({k: side[k] for k in ("shard", "first", "count", "file", "bytes", CHECKSUM)})
            total = stats_mod.merge(total, side["stats"])
        idx_bytes = index.tobytes()
        write_bytes_atomic(os.path.join(self.path, SAMPLE_INDEX), idx_bytes)
        _fault_point("finalize")
        import hashlib
        manifest = dict(self.settings)
        manifest.update(shards=shards, sample_index={"file": SAMPLE_INDEX, "dtype": str(SAMPLE_INDEX_DTYPE.descr),
                                                     CHECKSUM: hashlib.sha256(idx_bytes).hexdigest()},
                        stats=total, checksum=CHECKSUM)
        write_json_atomic(os.path.join(self.path, MANIFEST), manifest)
        return manifest
