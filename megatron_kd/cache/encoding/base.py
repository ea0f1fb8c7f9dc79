"""What every cache encoding shares: the base class (its settings' checks, the shape and range checks of a sample's
top-K), the byte layout of fixed-size per-sample streams, and the id width of a vocabulary."""
import dataclasses

import numpy as np

from ...rules import top_k_fits


def setting(flag: str, **argparse_kw):
    """A field of an encoding's settings record: None unless given; `flag` and argparse's keywords make its
    command-line flag (add_flags)."""
    return dataclasses.field(default=None, metadata={"flag": (flag, dict(default=None, **argparse_kw))})


def id_bits(vocab_size: int) -> int:
    return max(1, (int(vocab_size) - 1).bit_length())


class Fields:
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


def pad8(nbytes):
    return (nbytes + 7) // 8 * 8


class EncodingBase:
    name = ""
    variable = False  # True: a sample's byte size depends on its content (sample_bytes is then the largest)
    select = None     # the entries a sample keeps, when it keeps fewer than K (TopPEncoding.select)

    # Its own settings beside K: a dataclass whose fields are their keys (in a cache's settings, on the command line
    # as --key-name from the field's metadata["flag"], in a recipe as kd.cache_KEY); None: it takes none.
    settings = None
    implied_by = None  # the key of its settings that, given without an encoding, asks for this one
    needs = None       # (key, problem): the key it cannot do without, and the problem code naming its absence
    foreign = None     # the problem code of its keys given to another encoding

    @classmethod
    def keys(cls) -> tuple:
        return tuple(f.name for f in dataclasses.fields(cls.settings)) if cls.settings else ()

    @staticmethod
    def check_fixed_k(name: str, top_p) -> None:
        """A P given to an encoding that keeps K entries, or none given to topp (min_k alone is the settings'
        check: it has a default here)."""
        from . import EncodingOptions
        problem = EncodingOptions.of(name, top_p=top_p).problem()
        if problem:
            raise ValueError("the topp encoding needs top_p, and only it takes one" if problem == "needs_top_p" else
                             f"top_p={top_p} needs the encoding 'topp' (the encoding {name!r} stores K entries per "
                             "position)")

    @classmethod
    def forced_top_k(cls, options) -> int | None:
        """The K its cache must have where the encoding decides it (None: K is the build's own setting)."""
        return None

    @classmethod
    def settings_problem(cls, options) -> str | None:
        """One sentence on a value of its own settings it cannot take (given to any encoding), or None."""
        return None

    @classmethod
    def make(cls, vocab_size, top_k, seq_length, top_p=None, min_k=None):
        """The encoding of these settings (ValueError naming what does not fit it)."""
        cls.check_fixed_k(cls.name, top_p)
        return cls(vocab_size, top_k, seq_length)

    def settings_extra(self, options) -> dict:
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
