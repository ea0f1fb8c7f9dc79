"""compact (lossy, about 248 bytes/token at K=100, V=201,088): ids as an Elias-Fano set (ascending); per position the
log of the covered mass (fp32) and the range R of (max log-prob - log-prob) (fp16); every entry's r = max - logprob
on a 5-bit uniform grid over [0, R]; the ceil(K/5) entries with the smallest codes get a 7-bit refinement of their
residual. Decoding renormalizes the entries to the stored covered mass, so the mass the loss sees is exact. No empty
slots. Entries come back sorted by log-prob."""
import numpy as np

from ..bits import EliasFano, pack_uint, packed_bytes, unpack_uint
from .base import EncodingBase, Fields


class CompactEncoding(EncodingBase):
    name = "compact"
    coarse_bits, refine_bits, refine_every = 5, 7, 5
    r_cap = 100.0  # nats below the top entry: further is stored as this (p / p_max < 4e-44)

    def __init__(self, vocab_size, top_k, seq_length):
        super().__init__(vocab_size, top_k, seq_length)
        self.ef = EliasFano(self.vocab_size, self.k)
        self.m = -(-self.k // self.refine_every)
        s, k = self.seq, self.k
        self.fields = Fields([
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


ENCODING = CompactEncoding
