"""How one sample's [S, K] top-K ids and log-probs become a fixed number of bytes, and back: one encoding per file here.

Every sample of a cache has the same byte size, so sample i of a shard starts at (i - first) * sample_bytes (a
variable-size encoding, topp or sampled, ends each shard with a table of sample offsets instead). Each field is a
stream over the S positions, so positions [a, b) decode without touching the others. Each file's docstring gives its
layout: fp16 (the default), fp32, compact, topp, sampled.

An encoding is one class (base.EncodingBase) that declares its own settings record (`settings`: the keys it takes
beside K, with their command-line flags), the key that implies it and the one it needs, its validation (`make`,
`settings_problem`), its K rule (`forced_top_k`) and what it adds to a cache's settings (`settings_extra`).
get_encoding looks a name up. What a build asks of its encoding travels as one EncodingOptions from the recipe, the
command line (from_args; add_flags gives `megatron-kd cache build` and Bridge's cache command their flags from the
registry) or a cache's settings (from_settings) to the builder and the reader.

Adding an encoding: a file here defining ENCODING (its class), and its module name in REGISTERED; the commands offer
it from the registry.
"""
import dataclasses
import importlib

from ... import rules
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


def _owners() -> list:
    """The registered encodings that declare settings of their own (a subclass takes none of its parent's)."""
    return [cls for cls in REGISTRY.values() if cls.__dict__.get("settings") is not None]


def setting_keys() -> tuple:
    """The keys of every registered encoding's own settings, in the registry's order."""
    return tuple(k for cls in _owners() for k in cls.keys())


@dataclasses.dataclass(frozen=True)
class EncodingOptions:
    """What a cache build asks of its encoding, as one object: the encoding's name (None: the one a given setting
    implies, else rules.DEFAULT_ENCODING), K (None: the encoding's rule, else the build's default) and the values
    given to the encodings' own settings (`given`: (key, value) pairs; of() takes them by key)."""
    encoding: str | None = None
    top_k: int | None = None
    given: tuple = ()

    @classmethod
    def of(cls, encoding=None, top_k=None, **own) -> "EncodingOptions":
        keys = setting_keys()
        unknown = sorted(set(own) - set(keys))
        if unknown:
            raise TypeError(f"unknown cache encoding settings {unknown}; the encodings take {', '.join(keys)}")
        return cls(encoding, top_k, tuple((k, own[k]) for k in keys if own.get(k) is not None))

    @classmethod
    def from_args(cls, args, top_k=None) -> "EncodingOptions":
        """--encoding and the encodings' own flags (add_flags) of a parsed command line."""
        return cls.of(args.encoding, top_k, **{k: getattr(args, k, None) for k in setting_keys()})

    @classmethod
    def from_recipe(cls, kd, top_k=None) -> "EncodingOptions":
        """A recipe's kd.cache_encoding and each encoding's own kd.cache_KEY."""
        return cls.of(kd.cache_encoding, top_k, **{k: getattr(kd, f"cache_{k}", None) for k in setting_keys()})

    @classmethod
    def from_settings(cls, meta: dict) -> "EncodingOptions":
        """The options a manifest, settings.json or sidecar's settings were built with."""
        return cls.of(meta["encoding"], meta["top_k"], **{k: meta.get(k) for k in setting_keys()})

    def get(self, key):
        return dict(self.given).get(key)

    def replace(self, **changes) -> "EncodingOptions":
        return dataclasses.replace(self, **changes)

    @property
    def name(self) -> str:
        """The encoding the build uses: the one asked for, else the one a given setting implies (--top-p: topp,
        --samples: sampled), else the default."""
        if self.encoding:
            return self.encoding
        for cls in _owners():
            if cls.implied_by is not None and self.get(cls.implied_by) is not None:
                return cls.name
        return rules.DEFAULT_ENCODING

    def problem(self) -> str | None:
        """None when the encoding and the settings given agree; else the problem code of the first that does not:
        a setting given to an encoding that does not take it (its owner's `foreign`: the fix is to drop it, so it
        comes first), or a setting the encoding needs left out (its `needs`). The caller names its own keys."""
        name = self.name
        for cls in _owners():
            if cls.name != name and cls.foreign and any(self.get(k) is not None for k in cls.keys()):
                return cls.foreign
        cls = REGISTRY.get(name)
        if cls is not None and cls.needs and self.get(cls.needs[0]) is None:
            return cls.needs[1]
        return None

    def forced_top_k(self) -> int | None:
        """The K the cache must have where its encoding decides it (a sampled cache's K is its number of draws).
        None: K is the build's own setting (or the encoding is not registered: refused elsewhere)."""
        cls = REGISTRY.get(self.name)
        return cls.forced_top_k(self) if cls is not None else None

    def settings_problem(self) -> str | None:
        """A value of an encoding's own settings that no build can take (one sentence), or None."""
        for cls in _owners():
            problem = cls.settings_problem(self)
            if problem:
                return problem
        return None

    def make(self, vocab_size: int, seq_length: int):
        """The encoding object of these options (top_k resolved)."""
        return get_encoding(self.name, vocab_size, self.top_k, seq_length, self.get("top_p"), self.get("min_k"))


def add_flags(parser) -> None:
    """--encoding (the registered names) and each encoding's own flags, for a command that builds a cache."""
    parser.add_argument("--encoding", choices=ENCODINGS, default=None,
                        help="default fp16; topp when --top-p is given, sampled when --samples is")
    for cls in _owners():
        for f in dataclasses.fields(cls.settings):
            flag, kw = f.metadata["flag"]
            parser.add_argument(flag, **kw)


def get_encoding(name: str, vocab_size: int, top_k: int, seq_length: int, top_p=None, min_k=None):
    cls = REGISTRY.get(name)
    if cls is None:
        EncodingBase.check_fixed_k(name, top_p)  # a P given to an unknown name is named first
        raise ValueError(f"unknown cache encoding {name!r}; use one of {', '.join(ENCODINGS)}")
    return cls.make(vocab_size, top_k, seq_length, top_p, min_k)


def encoding_of(meta: dict):
    """The encoding a manifest, settings.json or sidecar's settings describe."""
    return EncodingOptions.from_settings(meta).make(meta["vocab_size"], meta["seq_length"])


ENCODINGS = tuple(REGISTRY)  # fp16, fp32, compact, topp, sampled
