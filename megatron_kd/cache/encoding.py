"""How one sample's [S, K] top-K ids and log-probs become a fixed number of bytes, and back.

Every sample of a cache has the same byte size, so sample i of a shard starts at (i - first) * sample_bytes.
Each field is a stream over the S positions, so positions [a, b) decode without touching the others.

- "fp16" (default): ids bit-packed in ceil(log2 V) bits each, in rank order; log-probs as float16.
  Empty slots (id -1) are stored as id 0 with log-prob -inf; finite log-probs are clamped to fp16's range.
- "fp32": the same with the log-probs as float32 (lossless for an fp32 teacher; twice fp16's log-prob bytes).
- "compact" (lossy, about 248 bytes/token at K=100, V=201,088): ids as an Elias-Fano set (ascending);
  per position the log of the covered mass (fp32) and the range R of (max log-prob - log-prob) (fp16);
  every entry's r = max - logprob on a 5-bit uniform grid over [0, R]; the ceil(K/5) entries with the
  smallest codes get a 7-bit refinement of their residual. Decoding renormalizes the entries to the stored
  covered mass, so the mass the loss sees is exact. No empty slots. Entries come back sorted by log-prob.
- "topp" (lossy, variable size): per position only the fewest entries whose mass reaches top_p (cache/topp.py),
  stored as compact stores K, plus the per-position count. The sample's byte size follows from its counts, so a
  shard ends with a table of sample offsets (writer.py); positions [a, b) decode from the counts' prefix sums.
  Unused slots read as id -1 / log-prob -inf.
- "sampled" (unbiased, variable size): per position the distinct ids of N draws from the teacher's full
  distribution (parallel/sample.py) and their counts; the reader returns log(count / N).

Each encoding is one class registered under its name (@register): get_encoding looks it up, its `make` checks the
settings it takes, `settings_extra` is what it adds to a cache's settings, `flags` its own command-line flags
(add_flags: `megatron-kd cache build` and Bridge's cache command), and `draws_are_k` says that K is its number of
draws (forced_top_k). A new encoding is a new registered class; the commands offer it from the registry.
"""
import numpy as np

from ..rules import encoding_problem, top_k_fits
from .bits import (EliasFano, pack_bool, pack_uint, pack_var, packed_bytes, unpack_bool, unpack_narrow, unpack_uint,
                   unpack_var)
from .topp import check_top_p, select_top_p

# name -> encoding class, in the order they are offered; each class registers itself (@register) and declares
# what it takes (make), checks, and writes to a cache's settings (settings_extra). ENCODINGS: the names.
REGISTRY: dict = {}


def register(cls):
    REGISTRY[cls.name] = cls
    return cls


def add_flags(parser) -> None:
    """--encoding (the registered names) and each encoding's own flags, for a command that builds a cache."""
    parser.add_argument("--encoding", choices=ENCODINGS, default=None,
                        help="default fp16; topp when --top-p is given, sampled when --samples is")
    for cls in REGISTRY.values():
        for flag, kw in cls.__dict__.get("flags", ()):
            parser.add_argument(flag, **kw)


def forced_top_k(name: str, samples) -> int | None:
    """The K a cache of encoding `name` must have where the encoding decides it: a sampled cache's K equals its
    number of draws. None: K is the build's own setting (or `name` is not registered: refused elsewhere)."""
    cls = REGISTRY.get(name)
    return int(samples) if cls is not None and cls.draws_are_k and samples is not None else None


def id_bits(vocab_size: int) -> int:
    return max(1, (int(vocab_size) - 1).bit_length())


def get_encoding(name: str, vocab_size: int, top_k: int, seq_length: int, top_p=None, min_k=None):
    cls = REGISTRY.get(name)
    if cls is None:
        _Base.check_fixed_k(name, top_p)  # a P given to an unknown name is named first
        raise ValueError(f"unknown cache encoding {name!r}; use one of {', '.join(ENCODINGS)}")
    return cls.make(vocab_size, top_k, seq_length, top_p, min_k)


class _Fields:
    """Byte offsets of named per-sample streams, each padded to 8 bytes."""

    def __init__(self, sizes):
        self.offset, self.size, at = {}, {}, 0
        for name, n in sizes:
            self.offset[name], self.size[name] = at, n
            at += (n + 7) // 8 * 8
        self.total = at

    def view(self, buf, name):
        a = self.offset[name]
        return buf[a:a + self.size[name]]


def encoding_of(meta: dict):
    """The encoding a manifest, settings.json or sidecar's settings describe."""
    return get_encoding(meta["encoding"], meta["vocab_size"], meta["top_k"], meta["seq_length"], meta.get("top_p"),
                        meta.get("min_k"))


class _Base:
    name = ""
    variable = False  # True: a sample's byte size depends on its content (sample_bytes is then the largest)
    select = None     # the entries a sample keeps, when it keeps fewer than K (TopPEncoding.select)

    @staticmethod
    def check_fixed_k(name: str, top_p) -> None:
        """A P given to an encoding that keeps K entries, or none given to topp (min_k alone is the settings'
        check: it has a default here)."""
        problem = encoding_problem(name, top_p, None)
        if problem:
            raise ValueError("the topp encoding needs top_p, and only it takes one" if problem == "needs_top_p" else
                             f"top_p={top_p} needs the encoding 'topp' (the encoding {name!r} stores K entries per "
                             "position)")

    # the command-line flags of its own settings (cache build, Bridge's cache build): (flag, argparse keywords)
    flags = ()
    # True: K is the number of draws per position (the most distinct ids a position can hold), not a setting
    draws_are_k = False

    @classmethod
    def make(cls, vocab_size, top_k, seq_length, top_p=None, min_k=None):
        """The encoding of these settings (ValueError naming what does not fit it)."""
        cls.check_fixed_k(cls.name, top_p)
        return cls(vocab_size, top_k, seq_length)

    def settings_extra(self, samples=None, sample_seed=None) -> dict:
        """What this encoding adds to a cache's settings beside the fields every cache records."""
        return {}

    def __init__(self, vocab_size: int, top_k: int, seq_length: int):
        self.vocab_size, self.k, self.seq = int(vocab_size), int(top_k), int(seq_length)
        if self.vocab_size < 1 or self.seq < 1 or not top_k_fits(self.k, self.vocab_size):
            raise ValueError(f"need vocab_size >= 1, seq_length >= 1 and 1 <= top_k <= vocab_size; got V={vocab_size}, "
                             f"S={seq_length}, K={top_k}")

    @property
    def sample_bytes(self) -> int:
        return self.fields.total

    @property
    def bytes_per_token(self) -> float:
        return self.sample_bytes / self.seq

    def check_shape(self, ids, logp) -> None:
        if tuple(ids.shape) != (self.seq, self.k) or tuple(logp.shape) != tuple(ids.shape):
            raise ValueError(f"expected topk_ids and topk_logprobs of shape [S, K] = [{self.seq}, {self.k}], "
                             f"got {tuple(ids.shape)} and {tuple(logp.shape)}")

    def _check(self, ids, logp):
        ids = np.asarray(ids)
        logp = np.asarray(logp, dtype=np.float32)
        self.check_shape(ids, logp)
        if ids.size and (ids.min() < -1 or ids.max() >= self.vocab_size):
            raise ValueError(f"topk ids must be in [-1, {self.vocab_size - 1}], found [{ids.min()}, {ids.max()}]")
        if np.isnan(logp).any() or (logp > 1e-3).any():
            raise ValueError("topk log-probs must be <= 0 and not NaN; pass log_softmax values, not logits")
        return ids.astype(np.int64), logp


@register
class Fp16Encoding(_Base):
    name = "fp16"
    dtype = np.float16

    def __init__(self, vocab_size, top_k, seq_length):
        super().__init__(vocab_size, top_k, seq_length)
        self.bits = id_bits(self.vocab_size)
        self.width = np.dtype(self.dtype).itemsize
        n = self.seq * self.k
        self.fields = _Fields([("logprobs", self.width * n), ("ids", packed_bytes(n, self.bits))])

    def encode(self, ids, logp) -> np.ndarray:
        ids, logp = self._check(ids, logp)
        empty = ids < 0
        lp = np.where(empty, -np.inf, np.maximum(logp, float(np.finfo(self.dtype).min))).astype(self.dtype)
        out = np.zeros(self.sample_bytes, dtype=np.uint8)
        self.fields.view(out, "logprobs")[:] = lp.view(np.uint8).ravel()
        self.fields.view(out, "ids")[:] = pack_uint(np.where(empty, 0, ids), self.bits)
        return out

    def decode(self, buf, start: int = 0, stop: int | None = None):
        stop = self.seq if stop is None else stop
        n, a, w = (stop - start) * self.k, start * self.k, self.width
        raw = np.asarray(self.fields.view(buf, "logprobs")[w * a:w * (a + n)])
        lp = raw.view(self.dtype).astype(np.float32).reshape(-1, self.k)
        ids = unpack_uint(self.fields.view(buf, "ids"), self.bits, n, a).reshape(-1, self.k)
        ids[np.isneginf(lp)] = -1
        return ids, lp


@register
class Fp32Encoding(Fp16Encoding):
    """The fp16 layout with the log-probs as float32: lossless for an fp32 teacher's log-probs, for a student as
    close to its teacher as a quantized copy (its KL to the teacher of the order of fp16's rounding)."""
    name = "fp32"
    dtype = np.float32


@register
class CompactEncoding(_Base):
    name = "compact"
    coarse_bits, refine_bits, refine_every = 5, 7, 5
    r_cap = 100.0  # nats below the top entry: further is stored as this (p / p_max < 4e-44)

    def __init__(self, vocab_size, top_k, seq_length):
        super().__init__(vocab_size, top_k, seq_length)
        self.ef = EliasFano(self.vocab_size, self.k)
        self.m = -(-self.k // self.refine_every)
        s, k = self.seq, self.k
        self.fields = _Fields([
            ("log_mass", 4 * s), ("range", 2 * s),
            ("upper", packed_bytes(s * self.ef.upper_bits, 1)),
            ("low", packed_bytes(s * k, self.ef.low_bits) if self.ef.low_bits else 0),
            ("coarse", packed_bytes(s * k, self.coarse_bits)),
            ("refine", packed_bytes(s * self.m, self.refine_bits)),
        ])

    def _grid(self, rng16):
        step = rng16.astype(np.float32) / np.float32((1 << self.coarse_bits) - 1)
        return step[:, None]

    def _refined(self, codes, valid=None):
        # The entries with the smallest codes (the most probable), ties by position: the decoder finds the
        # same ones from the codes alone. Unused slots (valid False) sort last.
        if valid is not None:
            codes = np.where(valid, codes, 1 << 30)
        return np.argsort(codes, axis=1, kind="stable")[:, :self.m]

    def _quantize(self, r, valid=None):
        """r = max log-prob - log-prob [n, K] (float32; 0 where not valid) -> (range fp16 [n], coarse codes
        [n, K], refinement codes [n, m] of the entries _refined picks)."""
        rng16 = r.max(axis=1).astype(np.float16)
        low = rng16.astype(np.float32) < r.max(axis=1)
        rng16[low] = np.nextafter(rng16[low], np.float16(np.inf))  # round up: every r fits the grid
        step = self._grid(rng16)
        lev = (1 << self.coarse_bits) - 1
        codes = np.where(step > 0, np.rint(r / np.where(step > 0, step, 1)), 0).clip(0, lev).astype(np.int64)
        pick = self._refined(codes, valid)
        resid = np.take_along_axis(r - codes * step, pick, 1)
        half = (1 << (self.refine_bits - 1)) - 1  # residual grid: -half..half of step / (2 * half); 0 is on it
        safe = np.where(step > 0, step, 1)
        ref = (np.rint(resid / safe * (2 * half)) + half).clip(0, 2 * half).astype(np.int64)
        return rng16, codes, ref

    def _dequantize(self, rng16, codes, ref, valid=None):
        """_quantize's inverse: r [n, K] (float32) from the range, coarse codes and refinement codes."""
        step = self._grid(rng16)
        r = codes * step
        pick = self._refined(codes, valid)
        half = (1 << (self.refine_bits - 1)) - 1
        fine = np.take_along_axis(r, pick, 1) + (ref - half) / (2 * half) * step
        np.put_along_axis(r, pick, fine, 1)
        return r

    def encode(self, ids, logp) -> np.ndarray:
        ids, logp = self._check(ids, logp)
        if (ids < 0).any():
            raise ValueError("the compact encoding cannot store empty slots (id -1); use encoding 'fp16'")
        order = np.argsort(ids, axis=1, kind="stable")
        ids = np.take_along_axis(ids, order, 1)
        if (np.diff(ids, axis=1) == 0).any():
            raise ValueError("topk ids repeat within a position; the teacher top-K must name distinct ids")
        lp = np.take_along_axis(logp, order, 1).astype(np.float64)
        top = lp.max(axis=1, keepdims=True)
        log_mass = (top[:, 0] + np.log(np.exp(lp - top).sum(axis=1))).astype(np.float32)
        r = np.minimum(top - lp, self.r_cap).astype(np.float32)
        rng16, codes, ref = self._quantize(r)

        out = np.zeros(self.sample_bytes, dtype=np.uint8)
        self.fields.view(out, "log_mass")[:] = log_mass.view(np.uint8)
        self.fields.view(out, "range")[:] = rng16.view(np.uint8)
        low_s, up_s = self.ef.encode(ids)
        self.fields.view(out, "upper")[:] = up_s
        if self.ef.low_bits:
            self.fields.view(out, "low")[:] = low_s
        self.fields.view(out, "coarse")[:] = pack_uint(codes, self.coarse_bits)
        self.fields.view(out, "refine")[:] = pack_uint(ref, self.refine_bits)
        return out

    def decode(self, buf, start: int = 0, stop: int | None = None):
        stop = self.seq if stop is None else stop
        n, k = stop - start, self.k
        log_mass = np.asarray(self.fields.view(buf, "log_mass")[4 * start:4 * stop]).view(np.float32)
        rng16 = np.asarray(self.fields.view(buf, "range")[2 * start:2 * stop]).view(np.float16)
        ids = self.ef.decode(self.fields.view(buf, "low"), self.fields.view(buf, "upper"), start, n)
        codes = unpack_uint(self.fields.view(buf, "coarse"), self.coarse_bits, n * k, start * k).reshape(n, k)
        ref = unpack_uint(self.fields.view(buf, "refine"), self.refine_bits, n * self.m, start * self.m)
        r = self._dequantize(rng16, codes, ref.reshape(n, self.m))
        x = -r.astype(np.float64)
        x += (log_mass.astype(np.float64) - np.log(np.exp(x).sum(axis=1)))[:, None]
        order = np.argsort(-x, axis=1, kind="stable")  # by log-prob, ties by id
        return np.take_along_axis(ids, order, 1), np.take_along_axis(x, order, 1).astype(np.float32)


def _pad8(nbytes):
    return (nbytes + 7) // 8 * 8


@register
class TopPEncoding(CompactEncoding):
    """compact's codes for the kept entries of each position (cache/topp.py) plus their count.

    Sample layout: counts (count_bits each, the fewest bits that hold K), log_mass (fp32), range (fp16): fixed
    per-position fields; then four streams whose sizes follow from the counts, each padded to 8 bytes: the
    Elias-Fano upper bitmaps (k + ((V - 1) >> L) + 1 bits for a position of k ids, L = floor(log2(V / k))), their
    low bits (k * L), the 5-bit coarse codes (k) and the 7-bit refinements (ceil(k / 5)). Position t's bits start
    at the prefix sums of these sizes over positions < t, so [a, b) decodes from the counts alone.
    """
    name = "topp"
    variable = True
    flags = (("--top-p", dict(type=float, default=None, metavar="P", help="keep per position the fewest ids (at most "
                              "--top-k) whose teacher mass reaches P (encoding topp; docs/cache-format.md)")),
             ("--min-k", dict(type=int, default=None, help="with --top-p: keep at least this many ids (default 1)")))

    @classmethod
    def make(cls, vocab_size, top_k, seq_length, top_p=None, min_k=None):
        cls.check_fixed_k(cls.name, top_p)
        return cls(vocab_size, top_k, seq_length, top_p, 1 if min_k is None else min_k)

    def settings_extra(self, samples=None, sample_seed=None) -> dict:
        return {"top_p": self.top_p, "min_k": self.min_k}

    def __init__(self, vocab_size, top_k, seq_length, top_p, min_k=1):
        _Base.__init__(self, vocab_size, top_k, seq_length)
        problem = check_top_p(top_p, min_k, top_k)
        if problem:
            raise ValueError(problem)
        self.top_p, self.min_k = float(top_p), int(min_k)
        self.m = -(-self.k // self.refine_every)
        self.count_bits = self.k.bit_length()
        ks = np.arange(self.k + 1)
        self.low_bits_of = np.array([EliasFano(self.vocab_size, max(1, k)).low_bits for k in ks], dtype=np.int64)
        self.upper_bits_of = ks + ((self.vocab_size - 1) >> self.low_bits_of) + 1
        self.refined_of = -(-ks // self.refine_every)
        s = self.seq
        self.header = _Fields([("counts", packed_bytes(s, self.count_bits)), ("log_mass", 4 * s), ("range", 2 * s)])
        # bounds of a sample's size: each stream at its largest (smallest) bits per position over k = 1..K (a
        # stream's bits need not grow with k: at V=2 a single id takes a low bit that two ids do not)
        per_k = self._stream_bits(np.arange(1, self.k + 1))
        self.max_bytes = self.header.total + sum(_pad8((s * int(b) + 7) // 8) for b in per_k.max(axis=1))
        self.min_bytes = self.header.total + sum(_pad8((s * int(b) + 7) // 8) for b in per_k.min(axis=1))

    @property
    def sample_bytes(self) -> int:
        """A bound on the largest sample: what shard sizes are planned with."""
        return self.max_bytes

    def select(self, ids, logp):
        """The entries this encoding keeps: (ids, log-probs) [S, K], unused slots -1 / -inf."""
        sel_ids, sel_lp, _ = select_top_p(ids, logp, self.top_p, self.min_k)
        return sel_ids, sel_lp

    def _stream_bits(self, counts):
        """Per position: bits of the upper, low, coarse and refine streams [4, n]."""
        return np.stack([self.upper_bits_of[counts], counts * self.low_bits_of[counts], counts * self.coarse_bits,
                         self.refined_of[counts] * self.refine_bits])

    def _layout(self, counts):
        """(start byte of each stream [4], total bytes) of a sample with these counts."""
        sizes = [_pad8((int(b) + 7) // 8) for b in self._stream_bits(counts).sum(axis=1)]
        starts = self.header.total + np.concatenate([[0], np.cumsum(sizes)[:-1]])
        return starts.astype(np.int64), self.header.total + int(sum(sizes))

    def size_of(self, counts) -> int:
        return self._layout(np.asarray(counts, dtype=np.int64))[1]

    def counts(self, buf) -> np.ndarray:
        """The per-position counts of a sample's bytes (int64 [S])."""
        return unpack_narrow(self.header.view(buf, "counts"), self.count_bits, self.seq)

    def _id_streams(self, flat_ids, counts):
        """The Elias-Fano upper and low streams (packed) of each position's ids, ascending, concatenated."""
        rows = np.repeat(np.arange(counts.size), counts)
        entry_start = np.cumsum(counts) - counts
        rank = np.arange(rows.size) - entry_start[rows]
        low_w = self.low_bits_of[counts][rows]
        up_bits = self.upper_bits_of[counts]
        up_start = np.cumsum(up_bits) - up_bits
        upper = np.zeros(int(up_bits.sum()), dtype=bool)
        upper[up_start[rows] + (flat_ids >> low_w) + rank] = True
        return pack_bool(upper), pack_var(flat_ids & ((1 << low_w) - 1), low_w)

    def _read_ids(self, buf, start, stop):
        """(counts [S], stream starts, per-stream bit offsets [n_streams, S + 1], entry offsets [S + 1], counts of
        [start, stop), the row of each id, the ids ascending per row) after the size and structure checks."""
        if buf.size < self.min_bytes:
            raise self._corrupt(f"{buf.size} bytes, fewer than the smallest sample ({self.min_bytes})")
        counts = self.counts(buf)
        if counts.min() < 1 or counts.max() > self.k:
            raise self._corrupt(f"a per-position count outside [1, K={self.k}]")
        starts, total = self._layout(counts)
        if total != buf.size:
            raise self._corrupt(f"its counts describe {total} bytes, it holds {buf.size}")
        bits = self._stream_bits(counts)
        begin = np.concatenate([np.zeros((bits.shape[0], 1), np.int64), np.cumsum(bits, axis=1)], axis=1)
        entry = np.concatenate([[0], np.cumsum(counts)])
        c = counts[start:stop]
        rows = np.repeat(np.arange(stop - start), c)
        rank = np.arange(rows.size) + entry[start] - np.repeat(entry[start:stop], c)  # repeat: cheaper than a gather
        # the upper bitmaps of rows [start, stop) hold one 1 per id, inside its own row
        up0 = begin[0, start]
        ones = np.flatnonzero(unpack_bool(buf[starts[0]:], up0, begin[0, stop] - up0))
        if ones.size != rows.size:
            raise self._corrupt(f"the Elias-Fano bitmaps hold {ones.size} ids, the counts say {rows.size}")
        in_row = ones + up0 - np.repeat(begin[0, start:stop], c)
        high = in_row - rank
        if rows.size and (in_row.min() < 0 or (in_row >= np.repeat(self.upper_bits_of[c], c)).any()):
            raise self._corrupt("a count disagrees with the ids stored for its position")
        low_w = np.repeat(self.low_bits_of[c], c)
        low = unpack_var(buf[starts[1]:], np.repeat(begin[1, start:stop], c) + rank * low_w, low_w)
        flat_ids = (high << low_w) | low
        if rows.size > 1 and ((np.diff(flat_ids) <= 0) & (np.diff(rows) == 0)).any():
            raise self._corrupt("a position's ids repeat")
        return counts, starts, begin, entry, c, rows, flat_ids

    def encode(self, ids, logp) -> np.ndarray:
        ids, logp = self._check(ids, logp)
        sel_ids, sel_lp, counts = select_top_p(ids, logp, self.top_p, self.min_k)
        if (counts < 1).any():
            raise ValueError("a position has no valid top-K entry (every id -1); the topp encoding keeps at least one")
        s, k = self.seq, self.k
        valid = np.arange(k) < counts[:, None]
        order = np.argsort(np.where(valid, sel_ids, np.iinfo(np.int64).max), axis=1, kind="stable")
        ids = np.take_along_axis(sel_ids, order, 1)  # kept ids ascending, then the unused slots
        if (np.diff(ids, axis=1)[valid[:, 1:]] == 0).any():
            raise ValueError("topk ids repeat within a position; the teacher top-K must name distinct ids")
        lp = np.take_along_axis(sel_lp, order, 1).astype(np.float64)
        for_top = np.where(valid, lp, -np.inf)
        top = for_top.max(axis=1, keepdims=True)
        log_mass = (top[:, 0] + np.log(np.exp(for_top - top).sum(axis=1))).astype(np.float32)
        r = np.where(valid, np.minimum(top - np.where(valid, lp, top), self.r_cap), 0).astype(np.float32)
        rng16, codes, ref = self._quantize(r, valid)
        refined = np.arange(self.m) < self.refined_of[counts][:, None]

        starts, total = self._layout(counts)
        out = np.zeros(total, dtype=np.uint8)
        self.header.view(out, "counts")[:] = pack_uint(counts, self.count_bits)
        self.header.view(out, "log_mass")[:] = log_mass.view(np.uint8)
        self.header.view(out, "range")[:] = rng16.view(np.uint8)
        streams = (*self._id_streams(ids[valid], counts), pack_uint(codes[valid], self.coarse_bits),
                   pack_uint(ref[refined], self.refine_bits))
        for a, data in zip(starts, streams):
            out[a:a + data.size] = data
        return out

    def _corrupt(self, what):
        return ValueError(f"{what}: the sample is corrupt; run `megatron-kd cache verify` on the cache and rebuild "
                          "the shard it names")

    def decode(self, buf, start: int = 0, stop: int | None = None):
        stop = self.seq if stop is None else stop
        n, k = stop - start, self.k
        buf = np.asarray(buf)
        counts, starts, begin, entry, c, rows, flat_ids = self._read_ids(buf, start, stop)
        log_mass = np.asarray(self.header.view(buf, "log_mass")[4 * start:4 * stop]).view(np.float32)
        rng16 = np.asarray(self.header.view(buf, "range")[2 * start:2 * stop]).view(np.float16)

        valid = np.arange(k) < c[:, None]
        ids = np.full((n, k), -1, dtype=np.int64)
        ids[valid] = flat_ids
        codes = np.zeros((n, k), dtype=np.int64)
        codes[valid] = unpack_narrow(buf[starts[2]:], self.coarse_bits, rows.size, int(entry[start]))
        refined = np.arange(self.m) < self.refined_of[c][:, None]
        half = (1 << (self.refine_bits - 1)) - 1
        ref = np.full((n, self.m), half, dtype=np.int64)  # half: a zero residual, for the entries not refined
        r0 = begin[3, start] // self.refine_bits
        ref[refined] = unpack_narrow(buf[starts[3]:], self.refine_bits, int(refined.sum()), int(r0))
        r = self._dequantize(rng16, codes, ref, valid)
        x = np.where(valid, -r.astype(np.float64), -np.inf)
        x += (log_mass.astype(np.float64) - np.log(np.exp(x).sum(axis=1)))[:, None]
        order = np.argsort(-x, axis=1, kind="stable")  # by log-prob, ties by id, unused slots last
        return np.take_along_axis(ids, order, 1), np.take_along_axis(x, order, 1).astype(np.float32)


@register
class SampledEncoding(TopPEncoding):
    """N draws per position from the teacher's full distribution (parallel/sample.py), as the distinct ids drawn and
    how often each was drawn; the reader returns log(count / N), so the targets sum to 1 exactly.

    Sample layout: per position the number k of distinct ids (count_bits each, the fewest bits that hold N) and a
    multiplicity bitmap of N bits (per id, ascending: count - 1 zeros then a one; the counts sum to N, so N bits
    hold them all), fixed per position; then two streams whose sizes follow from k, each padded to 8 bytes: the
    Elias-Fano upper bitmaps and low bits of the ids, as topp stores them. Position t's bits start at the prefix
    sums of these sizes over positions < t, so [a, b) decodes from the counts alone.
    """
    name = "sampled"
    top_p = None
    draws_are_k = True
    flags = (("--samples", dict(type=int, default=None, metavar="N", help="N draws per position from the teacher's "
                                "whole distribution, stored as the distinct ids and their counts (encoding sampled: "
                                "unbiased targets; docs/cache-format.md)")),
             ("--sample-seed", dict(type=int, default=None, help="with --samples: the draws' seed (default 0)")))

    @classmethod
    def make(cls, vocab_size, top_k, seq_length, top_p=None, min_k=None):
        """top_k: the draws per position, the most distinct ids a position can hold."""
        if top_p is not None or min_k is not None:
            raise ValueError("top_p / min_k select among the top-K; the encoding 'sampled' stores draws from the whole "
                             "distribution: drop them")
        return cls(vocab_size, top_k, seq_length)

    def settings_extra(self, samples=None, sample_seed=None) -> dict:
        return {"samples": int(samples), "sample_seed": int(sample_seed or 0)}

    def __init__(self, vocab_size, draws, seq_length):
        from ..parallel.sample import check_draws
        problem = check_draws(draws)
        if problem:
            raise ValueError(problem)
        _Base.__init__(self, vocab_size, min(int(draws), int(vocab_size)), seq_length)
        self.draws = int(draws)
        if self.k != self.draws:
            raise ValueError(f"samples={draws} draws per position need a vocabulary of at least {draws} ids "
                             f"(V={vocab_size}); draw fewer")
        self.count_bits = self.k.bit_length()
        ks = np.arange(self.k + 1)
        self.low_bits_of = np.array([EliasFano(self.vocab_size, max(1, k)).low_bits for k in ks], dtype=np.int64)
        self.upper_bits_of = ks + ((self.vocab_size - 1) >> self.low_bits_of) + 1
        s = self.seq
        self.header = _Fields([("counts", packed_bytes(s, self.count_bits)), ("mult", packed_bytes(s * self.draws, 1))])
        per_k = self._stream_bits(np.arange(1, self.k + 1))
        self.max_bytes = self.header.total + sum(_pad8((s * int(b) + 7) // 8) for b in per_k.max(axis=1))
        self.min_bytes = self.header.total + sum(_pad8((s * int(b) + 7) // 8) for b in per_k.min(axis=1))

    def select(self, ids, logp):
        """Every id drawn is kept: the kept count of the statistics is the number of distinct ids per position."""
        return ids, logp

    def _stream_bits(self, counts):
        """Per position: bits of the upper and low streams [2, n]."""
        return np.stack([self.upper_bits_of[counts], counts * self.low_bits_of[counts]])

    def frequencies(self, logp) -> np.ndarray:
        """Counts (int64) from log(count / N) values (-inf: 0)."""
        lp = np.asarray(logp, dtype=np.float64)
        return np.where(np.isneginf(lp), 0, np.rint(np.exp(np.where(np.isneginf(lp), 0.0, lp)) * self.draws)
                        ).astype(np.int64)

    def log_frequencies(self, counts) -> np.ndarray:
        """float32 log(count / N), -inf at 0: parallel/sample.py's log_frequencies, in numpy."""
        with np.errstate(divide="ignore"):
            return np.log(np.asarray(counts, dtype=np.float64) / float(self.draws)).astype(np.float32)

    def encode(self, ids, logp) -> np.ndarray:
        ids, logp = self._check(ids, logp)
        counts = self.frequencies(logp)
        counts[ids < 0] = 0
        live = counts > 0
        if (ids[live] < 0).any() or not np.array_equal(self.log_frequencies(counts)[live], logp[live]):
            raise ValueError(f"sampled targets must be log(count / {self.draws}) of distinct ids drawn (the "
                             "sampler's output); got other log-probs")
        if (counts.sum(axis=1) != self.draws).any():
            raise ValueError(f"a position's counts do not sum to samples={self.draws}")
        order = np.argsort(np.where(live, ids, np.iinfo(np.int64).max), axis=1, kind="stable")
        ids, counts = np.take_along_axis(ids, order, 1), np.take_along_axis(counts, order, 1)
        live = counts > 0
        k = live.sum(axis=1)
        if (np.diff(ids, axis=1)[live[:, 1:]] == 0).any():
            raise ValueError("sampled ids repeat within a position; pass each distinct id once with its count")
        s = self.seq
        # multiplicity bitmap: a one at the last draw of each id, in ascending id order within the position
        mult = np.zeros(s * self.draws, dtype=bool)
        mult[(np.arange(s)[:, None] * self.draws + np.cumsum(counts, axis=1) - 1)[live]] = True
        starts, total = self._layout(k)
        out = np.zeros(total, dtype=np.uint8)
        self.header.view(out, "counts")[:] = pack_uint(k, self.count_bits)
        self.header.view(out, "mult")[:] = pack_bool(mult)
        for a, data in zip(starts, self._id_streams(ids[live], k)):
            out[a:a + data.size] = data
        return out

    def decode(self, buf, start: int = 0, stop: int | None = None):
        stop = self.seq if stop is None else stop
        n, N = stop - start, self.draws
        buf = np.asarray(buf)
        _, _, _, _, c, rows, flat_ids = self._read_ids(buf, start, stop)
        mult = unpack_bool(self.header.view(buf, "mult"), start * N, n * N).reshape(n, N)
        if not np.array_equal(mult.sum(axis=1), c) or (n and not mult[:, -1].all()):
            raise self._corrupt("a multiplicity bitmap disagrees with the count of ids of its position")
        ends = np.flatnonzero(mult.ravel())  # the last draw of each id, rows in order
        # a position's first id counts from the position's first bit, the others from the previous id's last draw
        row_first = np.concatenate([[True], np.diff(rows) != 0]) if rows.size else np.zeros(0, bool)
        prev_end = np.concatenate([[-1], ends[:-1]])
        counts_flat = np.where(row_first, ends - rows * N + 1, ends - prev_end)
        valid = np.arange(self.k) < c[:, None]
        ids = np.full((n, self.k), -1, dtype=np.int64)
        ids[valid] = flat_ids
        counts = np.zeros((n, self.k), dtype=np.int64)
        counts[valid] = counts_flat
        big = 1 << 32
        order = np.argsort(-np.where(valid, counts * big + (big - 1 - ids), -1), axis=1, kind="stable")
        counts = np.take_along_axis(counts, order, 1)  # by count descending, ties by smaller id, unused last
        return np.take_along_axis(ids, order, 1), self.log_frequencies(counts)


ENCODINGS = tuple(REGISTRY)  # fp16, fp32, compact, topp, sampled
