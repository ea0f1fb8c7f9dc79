"""How one sample's [S, K] top-K ids and log-probs become a fixed number of bytes, and back: one encoding per file here.

Every sample of a cache has the same byte size, so sample i of a shard starts at (i - first) * sample_bytes (a
variable-size encoding, topp or sampled, ends each shard with a table of sample offsets instead). Each field is a
stream over the S positions, so positions [a, b) decode without touching the others. Each file's docstring gives its
layout: fp16 (the default), fp32, compact, topp, sampled.

An encoding is one class (base.EncodingBase): `make` checks the settings it takes, `settings_extra` is what it adds
to a cache's settings, `flags` its own command-line flags (add_flags: `megatron-kd cache build` and Bridge's cache
command), and `draws_are_k` says that K is its number of draws (forced_top_k). get_encoding looks a name up.

Adding an encoding: a file here defining ENCODING (its class), and its module name in REGISTERED; the commands offer
it from the registry.
"""
import importlib

from .base import EncodingBase

# one line per encoding, in the order they are offered: the module (this folder) that defines its ENCODING class
REGISTERED = (
    "fp16",
    "fp32",
    "compact",
    "topp",
    "sampled",
)

# name -> encoding class (REGISTERED's, in its order); ENCODINGS: the names.
REGISTRY: dict = {}


def register(cls):
    REGISTRY[cls.name] = cls
    return cls


for _module in REGISTERED:
    register(importlib.import_module(f"{__name__}.{_module}").ENCODING)


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


def get_encoding(name: str, vocab_size: int, top_k: int, seq_length: int, top_p=None, min_k=None):
    cls = REGISTRY.get(name)
    if cls is None:
        EncodingBase.check_fixed_k(name, top_p)  # a P given to an unknown name is named first
        raise ValueError(f"unknown cache encoding {name!r}; use one of {', '.join(ENCODINGS)}")
    return cls.make(vocab_size, top_k, seq_length, top_p, min_k)


def encoding_of(meta: dict):
    """The encoding a manifest, settings.json or sidecar's settings describe."""
    return get_encoding(meta["encoding"], meta["vocab_size"], meta["top_k"], meta["seq_length"], meta.get("top_p"),
                        meta.get("min_k"))


ENCODINGS = tuple(REGISTRY)  # fp16, fp32, compact, topp, sampled
