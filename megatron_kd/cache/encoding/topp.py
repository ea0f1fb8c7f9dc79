"""topp (lossy, variable size): per position only the fewest entries whose mass reaches top_p (cache/topp.py), stored as
compact stores K, plus the per-position count. The sample's byte size follows from its counts, so a shard ends with
a table of sample offsets (writer.py); positions [a, b) decode from the counts' prefix sums. Unused slots read as
id -1 / log-prob -inf."""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..bits import EliasFano, pack_bool, pack_uint, pack_var, packed_bytes, unpack_bool, unpack_narrow, unpack_var
from ..topp import check_top_p, select_top_p
from .base import EncodingBase, Fields, pad8, setting
from .compact import CompactEncoding


@dataclass(frozen=True)
class TopPSettings:
    top_p: Optional[float] = setting("--top-p", type=float, metavar="P", help="keep per position the fewest ids (at "
                                     "most --top-k) whose teacher mass reaches P (encoding topp; docs/cache-format.md)")
    min_k: Optional[int] = setting("--min-k", type=int, help="with --top-p: keep at least this many ids (default 1)")


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
    settings = TopPSettings
    implied_by = "top_p"
    needs = ("top_p", "needs_top_p")
    foreign = "fixed_k"  # top_p / min_k given to an encoding that stores K ids at every position

    @classmethod
    def make(cls, vocab_size, top_k, seq_length, top_p=None, min_k=None):
        cls.check_fixed_k(cls.name, top_p)
        return cls(vocab_size, top_k, seq_length, top_p, 1 if min_k is None else min_k)

    def settings_extra(self, options) -> dict:
        return {"top_p": self.top_p, "min_k": self.min_k}

    def __init__(self, vocab_size, top_k, seq_length, top_p, min_k=1):
        EncodingBase.__init__(self, vocab_size, top_k, seq_length)
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
        self.header = Fields([("counts", packed_bytes(s, self.count_bits)), ("log_mass", 4 * s), ("range", 2 * s)])
        # bounds of a sample's size: each stream at its largest (smallest) bits per position over k = 1..K (a
        # stream's bits need not grow with k: at V=2 a single id takes a low bit that two ids do not)
        per_k = self._stream_bits(np.arange(1, self.k + 1))
        self.max_bytes = self.header.total + sum(pad8((s * int(b) + 7) // 8) for b in per_k.max(axis=1))
        self.min_bytes = self.header.total + sum(pad8((s * int(b) + 7) // 8) for b in per_k.min(axis=1))

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
        sizes = [pad8((int(b) + 7) // 8) for b in self._stream_bits(counts).sum(axis=1)]
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


ENCODING = TopPEncoding
