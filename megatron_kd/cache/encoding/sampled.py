"""sampled (unbiased, variable size): per position the distinct ids of N draws from the teacher's full distribution
(parallel/sample.py) and their counts; the reader returns log(count / N)."""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..bits import EliasFano, pack_bool, pack_uint, packed_bytes, unpack_bool
from .base import EncodingBase, Fields, pad8, setting
from .topp import TopPEncoding


@dataclass(frozen=True)
class SampledSettings:
    samples: Optional[int] = setting("--samples", type=int, metavar="N", help="N draws per position from the "
                                     "teacher's whole distribution, stored as the distinct ids and their counts "
                                     "(encoding sampled: unbiased targets; docs/cache-format.md)")
    sample_seed: Optional[int] = setting("--sample-seed", type=int, help="with --samples: the draws' seed (default 0)")


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
    settings = SampledSettings
    implied_by = "samples"
    needs = ("samples", "needs_samples")
    foreign = "not_sampled"  # samples / sample_seed given to an encoding that stores the teacher's top ids

    @classmethod
    def forced_top_k(cls, options) -> int | None:
        """K is the number of draws per position (the most distinct ids a position can hold), not a setting."""
        samples = options.get("samples")
        return None if samples is None else int(samples)

    @classmethod
    def settings_problem(cls, options) -> str | None:
        seed = options.get("sample_seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
            return f"sample_seed={seed!r} must be an integer in [0, 2**63)"
        return None

    @classmethod
    def make(cls, vocab_size, top_k, seq_length, top_p=None, min_k=None):
        """top_k: the draws per position, the most distinct ids a position can hold."""
        if top_p is not None or min_k is not None:
            raise ValueError("top_p / min_k select among the top-K; the encoding 'sampled' stores draws from the whole "
                             "distribution: drop them")
        return cls(vocab_size, top_k, seq_length)

    def settings_extra(self, options) -> dict:
        return {"samples": int(options.get("samples")), "sample_seed": int(options.get("sample_seed") or 0)}

    def __init__(self, vocab_size, draws, seq_length):
        from ...parallel.sample import check_draws
        problem = check_draws(draws)
        if problem:
            raise ValueError(problem)
        EncodingBase.__init__(self, vocab_size, min(int(draws), int(vocab_size)), seq_length)
        self.draws = int(draws)
        if self.k != self.draws:
            raise ValueError(f"samples={draws} draws per position need a vocabulary of at least {draws} ids "
                             f"(V={vocab_size}); draw fewer")
        self.count_bits = self.k.bit_length()
        ks = np.arange(self.k + 1)
        self.low_bits_of = np.array([EliasFano(self.vocab_size, max(1, k)).low_bits for k in ks], dtype=np.int64)
        self.upper_bits_of = ks + ((self.vocab_size - 1) >> self.low_bits_of) + 1
        s = self.seq
        self.header = Fields([("counts", packed_bytes(s, self.count_bits)), ("mult", packed_bytes(s * self.draws, 1))])
        per_k = self._stream_bits(np.arange(1, self.k + 1))
        self.max_bytes = self.header.total + sum(pad8((s * int(b) + 7) // 8) for b in per_k.max(axis=1))
        self.min_bytes = self.header.total + sum(pad8((s * int(b) + 7) // 8) for b in per_k.min(axis=1))

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


ENCODING = SampledEncoding
