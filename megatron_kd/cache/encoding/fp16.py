"""fp16 (the default): ids bit-packed in ceil(log2 V) bits each, in rank order; log-probs as float16. Empty slots
(id -1) are stored as id 0 with log-prob -inf; finite log-probs are clamped to fp16's range."""
import numpy as np

from ..bits import pack_uint, packed_bytes, unpack_uint
from .base import EncodingBase, Fields, id_bits


class Fp16Encoding(EncodingBase):
    name = "fp16"
    dtype = np.float16

    def __init__(self, vocab_size, top_k, seq_length):
        super().__init__(vocab_size, top_k, seq_length)
        self.bits = id_bits(self.vocab_size)
        self.width = np.dtype(self.dtype).itemsize
        n = self.seq * self.k
        self.fields = Fields([("logprobs", self.width * n), ("ids", packed_bytes(n, self.bits))])

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


ENCODING = Fp16Encoding
