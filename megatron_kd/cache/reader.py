"""CacheReader: O(1) random access to sample i through numpy memory maps.

Sample i lives in shard i // samples_per_shard at byte (i % samples_per_shard) * sample_bytes. Shards are
mapped lazily, so opening a cache costs two JSON reads (manifest, settings), a stat per shard and a checksum of
samples.idx (16 bytes per sample); every manifest field is cross-checked then (checks.manifest_problems). The
reader pickles cheaply into DataLoader workers (maps are reopened there).
"""
import os

import numpy as np

from ..rules import same_temperature, top_k_fits, vocab_problem
from .checks import manifest_problems, rebuild_hint, shard_fix
from .encoding import encoding_of
from .errors import CacheError
from .format import (MANIFEST, OFFSETS_DTYPE, SAMPLE_INDEX, SAMPLE_INDEX_DTYPE, SETTINGS, check_format, num_shards,
                     offsets_problem, sidecar_name)
from .fsio import read_json
from .hashing import crc32, hex64, token_hash



def teacher_mismatch(cached: dict, expected) -> str | None:
    """None if the cache's teacher identity matches expected: a name, 'name@weights_hash' or a dict of identity
    fields (each given field must be equal); else a description naming both."""
    if expected is None or expected == "" or expected == {}:
        return None
    if isinstance(expected, str):
        name, _, weights = expected.partition("@")
        expected = {"name": name, **({"weights_hash": weights} if weights else {})}
    cached = cached if isinstance(cached, dict) else {"name": cached}
    wrong = [k for k, v in expected.items() if v is not None and str(cached.get(k)) != str(v)]
    if not wrong:
        return None
    return (f"teacher: the cache was built by {_who(cached)}, this run expects {_who(expected)} (differs in "
            f"{', '.join(wrong)})")


def fp8_precision(fp8, recipe) -> str:
    """The identity's record of a teacher that ran in FP8: 'FORMAT/RECIPE' (e.g. 'hybrid/tensorwise')."""
    recipe = getattr(recipe, "value", recipe)  # megatron-core's Fp8Recipe enum, or the recipe's string
    return f"{fp8}/{recipe}" if recipe else str(fp8)


def teacher_precision(ident) -> str:
    """'bf16' or 'fp8 (FORMAT/RECIPE)' of a cache's teacher identity; caches from before the identity's fp8 entry
    say FP8 only through their backend ('te+fp8...')."""
    ident = ident if isinstance(ident, dict) else {}
    if ident.get("fp8"):
        return f"fp8 ({ident['fp8']})"
    return "fp8" if "+fp8" in str(ident.get("backend", "")) else "bf16"


def mixed_precision_note(teachers: dict) -> str | None:
    """One sentence when the caches a run reads ({name: teacher identity}) come from teachers run at different
    precisions (bf16, FP8), else None."""
    prec = {name: teacher_precision(t) for name, t in teachers.items()}
    if len(set(prec.values())) < 2:
        return None
    return ("the caches this run reads come from teachers run at different precisions ("
            + ", ".join(f"{n}: {p}" for n, p in prec.items()) + "), so the sources' targets differ by the FP8 "
            "teacher's rounding as well; rebuild them with one teacher.fp8 setting for like targets")


def _who(ident: dict) -> str:
    return " ".join(f"{k}={ident[k]!r}" for k in ("name", "weights_hash", "config_hash") if k in ident) or repr(ident)


def load_manifest(path) -> dict:
    p = os.path.join(path, MANIFEST)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CacheError(f"cache directory {path} is a file, not a cache directory; give the directory `megatron-kd "
                         "cache build --out` wrote")
    if not os.path.isdir(path):
        raise CacheError(f"cache directory {path} does not exist; build it with `megatron-kd cache build --out {path}`")
    if not os.path.exists(p):
        if os.path.exists(os.path.join(path, SETTINGS)):
            settings = read_json(os.path.join(path, SETTINGS))
            done = sum(os.path.exists(os.path.join(path, sidecar_name(j))) for j in range(num_shards(settings)))
            raise CacheError(f"{path} has no manifest.json: its build has not finished ({done} of "
                             f"{num_shards(settings)} shards done); {rebuild_hint(path)}")
        raise CacheError(f"{path} has no manifest.json and is not a cache directory; build one with "
                         f"`megatron-kd cache build --out {path}`")
    try:
        manifest = read_json(p)
    except ValueError as e:
        raise CacheError(f"{p} is not valid JSON ({e}); delete it and {rebuild_hint(path)}") from None
    if not isinstance(manifest, dict):
        raise CacheError(f"{p} is not a JSON object; delete it and {rebuild_hint(path)}")
    check_format(manifest, p)
    return manifest


class CacheReader:
    def __init__(self, path, *, verify_reads: bool = True, expected_teacher=None):
        """verify_reads: check each sample's crc32 when read (about 1 ms per MB), so a corrupt shard fails loudly.
        expected_teacher: refuse a cache from another teacher (a name, 'name@weights_hash' or identity fields)."""
        self.path = os.fspath(path)
        self.verify_reads = verify_reads
        self.manifest = load_manifest(self.path)
        m = self.manifest
        problems = manifest_problems(self.path, m, first_only=True)
        if problems:
            raise CacheError(problems[0])
        self.check_teacher(expected_teacher)
        self.top_k, self.vocab_size, self.seq_length = m["top_k"], m["vocab_size"], m["seq_length"]
        self.temperature, self.encoding = m["temperature"], m["encoding"]
        self.samples_per_shard, self.sample_bytes = m["samples_per_shard"], m["sample_bytes"]
        self._enc = encoding_of(m)
        self.top_p = m.get("top_p")  # None: every position holds K entries
        self.samples = m.get("samples")  # a sampled cache: draws per position (None: top-K or top-P)
        self._maps, self._offsets = {}, {}
        self._index = None

    def check_teacher(self, expected) -> None:
        """Raise if the cache's teacher is not `expected` (a name, 'name@weights_hash' or identity fields; None:
        no check), naming both."""
        wrong = teacher_mismatch(self.manifest["teacher"], expected)
        if wrong:
            raise CacheError(f"cache {self.path} does not fit this run: {wrong}; use the cache built by this "
                             "teacher, or rebuild it with this teacher into another directory")

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_maps"], state["_index"], state["_offsets"] = {}, None, {}
        return state

    def __len__(self) -> int:
        return self.manifest["num_samples"]

    def _sample_index(self):
        if self._index is None:
            self._index = np.memmap(os.path.join(self.path, SAMPLE_INDEX), dtype=SAMPLE_INDEX_DTYPE, mode="r")
        return self._index

    def _shard(self, j: int):
        mm = self._maps.get(j)
        if mm is None:
            mm = np.memmap(os.path.join(self.path, self.manifest["shards"][j]["file"]), dtype=np.uint8, mode="r")
            self._maps[j] = mm
        return mm

    def _check_index(self, i) -> int:
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"sample index must be an int, got {type(i).__name__}")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range: the cache holds {n} samples")
        return int(i) % n

    def shard_offsets(self, j: int) -> np.ndarray:
        """Byte offsets of shard j's samples (count + 1 values; a variable-size encoding's table at the shard's end,
        else multiples of sample_bytes)."""
        off = self._offsets.get(j)
        if off is None:
            count = self.manifest["shards"][j]["count"]
            if not self._enc.variable:
                off = np.arange(count + 1, dtype=np.int64) * self.sample_bytes
            else:
                mm = self._shard(j)
                n = (count + 1) * OFFSETS_DTYPE.itemsize
                off = np.frombuffer(mm[max(0, mm.size - n):].tobytes(), dtype=OFFSETS_DTYPE).astype(np.int64)
                problem = (offsets_problem(off, mm.size, self._enc.max_bytes, self._enc.min_bytes) if mm.size >= n
                           else f"{mm.size} bytes cannot hold its offset table")
                if problem:
                    name = os.path.join(self.path, self.manifest["shards"][j]["file"])
                    raise CacheError(f"{name}: {problem} (the shard is corrupt); fix: {shard_fix(self.path, j)}")
            self._offsets[j] = off
        return off

    def raw(self, i: int) -> np.ndarray:
        """The sample's encoded bytes (a read-only memmap slice)."""
        i = self._check_index(i)
        j, r = divmod(i, self.samples_per_shard)
        off = self.shard_offsets(j)
        buf = self._shard(j)[off[r]:off[r + 1]]
        if self.verify_reads and crc32(buf) != int(self._sample_index()["crc32"][i]):
            raise CacheError(self._corrupt(i, j))
        return buf

    def _corrupt(self, i, j) -> str:
        name = os.path.join(self.path, self.manifest["shards"][j]["file"])
        return (f"{name}: sample {i} fails its crc32 check (the shard is corrupt; samples.idx was checked at open). "
                f"Fix: {shard_fix(self.path, j)}; `megatron-kd cache verify {self.path}` lists every corrupt shard")

    def check_samples(self, stop: int | None = None) -> None:
        """crc32 of samples [0, stop) (all by default) against samples.idx: a corrupt shard the run will read is
        found before training starts (reads every byte once: about 1 s per GB)."""
        stop = len(self) if stop is None else min(int(stop), len(self))
        want = self._sample_index()["crc32"]
        for j in range(-(-stop // self.samples_per_shard)):
            mm, off = self._shard(j), self.shard_offsets(j)
            first = j * self.samples_per_shard
            for i in range(first, min(stop, first + self.samples_per_shard)):
                r = i - first
                if crc32(mm[off[r]:off[r + 1]]) != int(want[i]):
                    raise CacheError(self._corrupt(i, j))

    def read(self, i: int, start: int = 0, stop: int | None = None) -> dict:
        """Positions [start, stop) of sample i: topk_ids int64 [n, K] (-1 = empty slot, its log-prob -inf),
        topk_logprobs float32 [n, K], sorted by log-prob descending."""
        stop = self.seq_length if stop is None else stop
        if not 0 <= start <= stop <= self.seq_length:
            raise IndexError(f"positions [{start}, {stop}) outside [0, {self.seq_length})")
        try:
            ids, lp = self._enc.decode(self.raw(i), start, stop)
        except ValueError as e:  # a variable-size sample whose counts and streams disagree
            j = i // self.samples_per_shard
            raise CacheError(f"{self.path}: sample {i} of {self.manifest['shards'][j]['file']} does not decode "
                             f"({e}); fix: {shard_fix(self.path, j)}") from None
        if ids.size and ids.max() >= self.vocab_size:
            j = i // self.samples_per_shard
            raise CacheError(f"{self.path}: sample {i} decodes to ids >= vocab_size {self.vocab_size} (corrupt shard "
                             f"{self.manifest['shards'][j]['file']}); fix: {shard_fix(self.path, j)}")
        return {"topk_ids": ids, "topk_logprobs": lp}

    def __getitem__(self, i: int) -> dict:
        return self.read(i)

    def token_hash(self, i: int) -> str:
        return hex64(int(self._sample_index()["token_hash"][self._check_index(i)]))

    def check_tokens(self, i: int, tokens) -> None:
        """Raise if `tokens` (the sample's seq_length input tokens) are not the ones the teacher saw."""
        n = int(np.prod(np.shape(tokens.cpu() if hasattr(tokens, "cpu") else tokens)))
        if n != self.seq_length:
            raise CacheError(f"sample {i} has {n} tokens, the cache was built with seq_length={self.seq_length}; "
                             "train with the cache's sequence length or rebuild the cache for this one")
        got = hex64(token_hash(tokens))
        want = self.token_hash(i)
        if got != want:
            raise CacheError(
                f"sample {i}: token hash {got} does not match the cache's {want} ({self.path}). The training data "
                "differs from what the teacher saw: another dataset, data seed/shuffle, sequence length, split or "
                f"tokenizer (cache: tokenizer={self.manifest.get('tokenizer')!r}, "
                f"dataset={self.manifest.get('dataset')!r}). Use the exact data settings of the cache build, "
                "or rebuild the cache for this data.")

    def check_compatible(self, *, vocab_size=None, top_k=None, temperature=None, seq_length=None,
                         keys: dict | None = None, tail=None, divergence=None, train_temperature=None) -> None:
        """Raise if a student run with these settings cannot use this cache. keys: the caller's name for each
        manifest field (e.g. {"top_k": "kd.top_k"}), so the message names the key a user sets. temperature: the
        capture temperature the run expects; tail, divergence, train_temperature: the loss's (a sampled cache's
        targets are an unbiased estimate for tail none, forward KL, trained at the capture temperature only)."""
        keys = {"vocab_size": "vocabulary", "top_k": "top_k", "temperature": "temperature",
                "seq_length": "seq_length", "tail": "tail", "divergence": "divergence",
                "train_temperature": "cache_temperature", **(keys or {})}
        samples = getattr(self, "samples", None)  # None: a top-K or top-P cache
        problems = sampled_loss_problems(samples, self.temperature, top_k, tail, divergence, train_temperature, keys)
        if vocab_size is not None and vocab_problem(self.vocab_size, vocab_size):
            problems.append(f"{keys['vocab_size']}: the teacher's is {self.vocab_size} ids, the student's is {vocab_size}; "
                            "top-K ids only mean the same tokens under one tokenizer: use the teacher's tokenizer "
                            "and pass the unpadded vocabulary size")
        if top_k is not None and not top_k_fits(top_k, self.top_k) and samples is None:
            problems.append(f"{keys['top_k']}: the run asks for K={top_k}, the cache stores K={self.top_k}; train with "
                            f"top_k <= {self.top_k} or rebuild with --top-k {top_k}")
        if temperature is not None and not same_temperature(self.temperature, temperature):
            problems.append(f"{keys['temperature']}: the cache was captured at T={self.temperature}, the run uses "
                            f"T={temperature}; set the distillation temperature to {self.temperature} or rebuild "
                            f"with --temperature {temperature}")
        if seq_length is not None and int(seq_length) != self.seq_length:
            problems.append(f"{keys['seq_length']}: the cache rows have {self.seq_length} positions, the run uses "
                            f"{seq_length}; use seq_length={self.seq_length} or rebuild the cache")
        if problems:
            raise CacheError(f"cache {self.path} does not fit this run:\n  " + "\n  ".join(problems))


def sampled_loss_problems(samples, capture_temperature, top_k=None, tail=None, divergence=None,
                          train_temperature=None, keys=None) -> list:
    """What keeps a loss from reading a sampled cache's count / N targets (N = samples) as an unbiased estimate of
    the teacher (docs/loss.md, "Sampled caches"); [] for other caches (samples None). keys: check_compatible's."""
    if samples is None:
        return []
    keys = keys or {}
    n, out = samples, []
    if top_k is not None and int(top_k) != n:
        out.append(f"{keys.get('top_k', 'top_k')}: the run asks for K={top_k}; a sampled cache's targets are the "
                   f"distinct ids of its {n} draws (they sum to 1), and keeping fewer biases them: train with "
                   "top_k = null (the cache's) or rebuild with another --samples")
    if tail is not None and tail != "none":
        out.append(f"{keys.get('tail', 'tail')}: the run uses tail={tail!r}; a sampled cache's targets count / {n} "
                   "already sum to 1 and estimate the whole distribution, which the other tails would distort: use "
                   "tail none")
    if divergence is not None and divergence != "forward_kl":
        out.append(f"{keys.get('divergence', 'divergence')}: the run uses {divergence}; only forward KL's gradient "
                   "is linear in the teacher's probabilities, so only it has an unbiased estimate from draws (reverse "
                   "KL and JSD take logs of the counts): use forward_kl, or a top-K cache for this divergence")
    if train_temperature is not None and not same_temperature(train_temperature, capture_temperature):
        out.append(f"{keys.get('train_temperature', 'cache_temperature')}: re-tempering ({capture_temperature} -> "
                   f"{train_temperature}) raises count / {n} to a power, which is not an unbiased estimate of the "
                   f"re-tempered teacher: build the cache with --temperature {train_temperature} and drop "
                   "cache_temperature")
    return out
