"""How one sample's [S, K] top-K ids and log-probs become a fixed number of bytes, and back.

Every sample of a cache has the same byte size, so sample i of a shard starts at (i - first) * sample_bytes.
Each field is a stream over the S positions, so positions [a, b) decode without touching the others.

- "fp16" (default): ids bit-packed in ceil(log2 V) bits each, in rank order; log-probs as float16.
  Empty slots (id -1) are stored as id 0 with log-prob -inf; finite log-probs are clamped to fp16's range.
- "compact" (lossy, about 248 bytes/token at K=100, V=201,088): ids as an Elias-Fano set (ascending);
  per position the log of the covered mass (fp32) and the range R of (max log-prob - log-prob) (fp16);
  every entry's r = max - logprob on a 5-bit uniform grid over [0, R]; the ceil(K/5) entries with the
  smallest codes get a 7-bit refinement of their residual. Decoding renormalizes the entries to the stored
  covered mass, so the mass the loss sees is exact. No empty slots. Entries come back sorted by log-prob.
"""
import numpy as np

from .bits import EliasFano, pack_uint, packed_bytes, unpack_uint

ENCODINGS = ("fp16", "compact")
_FP16_MIN = float(np.finfo(np.float16).min)


def id_bits(vocab_size: int) -> int:
    return max(1, (int(vocab_size) - 1).bit_length())


def get_encoding(name: str, vocab_size: int, top_k: int, seq_length: int):
    if name == "fp16":
        return Fp16Encoding(vocab_size, top_k, seq_length)
    if name == "compact":
        return CompactEncoding(vocab_size, top_k, seq_length)
    raise ValueError(f"unknown cache encoding {name!r}; use one of {', '.join(ENCODINGS)}")


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


class _Base:
    name = ""

    def __init__(self, vocab_size: int, top_k: int, seq_length: int):
        self.vocab_size, self.k, self.seq = int(vocab_size), int(top_k), int(seq_length)
        if self.vocab_size < 1 or self.seq < 1 or not 1 <= self.k <= self.vocab_size:
            raise ValueError(f"need vocab_size >= 1, seq_length >= 1 and 1 <= top_k <= vocab_size; got V={vocab_size}, "
                             f"S={seq_length}, K={top_k}")

    @property
    def sample_bytes(self) -> int:
        return self.fields.total

    @property
    def bytes_per_token(self) -> float:
        return self.sample_bytes / self.seq

    def _check(self, ids, logp):
        ids = np.asarray(ids)
        logp = np.asarray(logp, dtype=np.float32)
        if ids.shape != (self.seq, self.k) or logp.shape != ids.shape:
            raise ValueError(f"expected topk_ids and topk_logprobs of shape [S, K] = [{self.seq}, {self.k}], "
                             f"got {ids.shape} and {logp.shape}")
        if ids.size and (ids.min() < -1 or ids.max() >= self.vocab_size):
            raise ValueError(f"topk ids must be in [-1, {self.vocab_size - 1}], found [{ids.min()}, {ids.max()}]")
        if np.isnan(logp).any() or (logp > 1e-3).any():
            raise ValueError("topk log-probs must be <= 0 and not NaN; pass log_softmax values, not logits")
        return ids.astype(np.int64), logp


class Fp16Encoding(_Base):
    name = "fp16"

    def __init__(self, vocab_size, top_k, seq_length):
        super().__init__(vocab_size, top_k, seq_length)
        self.bits = id_bits(self.vocab_size)
        n = self.seq * self.k
        self.fields = _Fields([("logprobs", 2 * n), ("ids", packed_bytes(n, self.bits))])

    def encode(self, ids, logp) -> np.ndarray:
        ids, logp = self._check(ids, logp)
        empty = ids < 0
        lp16 = np.where(empty, -np.inf, np.maximum(logp, _FP16_MIN)).astype(np.float16)
        out = np.zeros(self.sample_bytes, dtype=np.uint8)
        self.fields.view(out, "logprobs")[:] = lp16.view(np.uint8).ravel()
        self.fields.view(out, "ids")[:] = pack_uint(np.where(empty, 0, ids), self.bits)
        return out

    def decode(self, buf, start: int = 0, stop: int | None = None):
        stop = self.seq if stop is None else stop
        n, a = (stop - start) * self.k, start * self.k
        raw = np.asarray(self.fields.view(buf, "logprobs")[2 * a:2 * (a + n)])
        lp = raw.view(np.float16).astype(np.float32).reshape(-1, self.k)
        ids = unpack_uint(self.fields.view(buf, "ids"), self.bits, n, a).reshape(-1, self.k)
        ids[np.isneginf(lp)] = -1
        return ids, lp


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

    def _refined(self, codes):
        # The entries with the smallest codes (the most probable), ties by position: the decoder finds the
        # same ones from the codes alone.
        return np.argsort(codes, axis=1, kind="stable")[:, :self.m]

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
        rng16 = r.max(axis=1).astype(np.float16)
        low = rng16.astype(np.float32) < r.max(axis=1)
        rng16[low] = np.nextafter(rng16[low], np.float16(np.inf))  # round up: every r fits the grid
        step = self._grid(rng16)
        lev = (1 << self.coarse_bits) - 1
        codes = np.where(step > 0, np.rint(r / np.where(step > 0, step, 1)), 0).clip(0, lev).astype(np.int64)
        pick = self._refined(codes)
        resid = np.take_along_axis(r - codes * step, pick, 1)
        half = (1 << (self.refine_bits - 1)) - 1  # residual grid: -half..half of step / (2 * half); 0 is on it
        safe = np.where(step > 0, step, 1)
        ref = (np.rint(resid / safe * (2 * half)) + half).clip(0, 2 * half).astype(np.int64)

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
        step = self._grid(rng16)
        r = codes * step
        pick = self._refined(codes)
        half = (1 << (self.refine_bits - 1)) - 1
        fine = np.take_along_axis(r, pick, 1) + (ref.reshape(n, self.m) - half) / (2 * half) * step
        np.put_along_axis(r, pick, fine, 1)
        x = -r.astype(np.float64)
        x += (log_mass.astype(np.float64) - np.log(np.exp(x).sum(axis=1)))[:, None]
        order = np.argsort(-x, axis=1, kind="stable")  # by log-prob, ties by id
        return np.take_along_axis(ids, order, 1), np.take_along_axis(x, order, 1).astype(np.float32)
