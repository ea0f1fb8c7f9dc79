"""Training data: Megatron's GPTDataset (indexed .bin/.idx, or its mock), the cache rows, the sample order.

Sample order follows Megatron-LM's pretraining sampler: global batch g holds dataset samples
[g * GBS, (g + 1) * GBS); within it, consecutive groups of micro_batch_size x DP samples form the micro-batches
and data-parallel rank r takes the r-th micro_batch_size slice of each group. The cache is keyed by the same
sample index, so every layout (TP, PP, CP, DP, micro-batch size) reads the rows of the tokens it trains on.
"""
import logging
import math
import os

import torch

from ..cache.hashing import tokenizer_id
from ..recipe.checks import CACHE_FIELD_KEYS
from ..recipe.schema import DataConfig, KDConfig, RecipeError, TrainConfig

class FileTokenizer:
    """A `tokenizers` JSON file, with the few attributes Megatron's GPTDataset reads (eod, pad, vocab_size)."""

    def __init__(self, path: str, eod_id: int | None = None):
        from ..errors import TokenizerError
        from .tokenizer import end_of_document, load
        if not os.path.exists(path):
            raise RecipeError(f"data.tokenizer={path!r} does not exist; `megatron-kd data prepare` writes one "
                              "(PREFIX.tokenizer.json next to the .bin/.idx) and prints the path")
        try:
            self.tok, path = load(path)
            eod = end_of_document(self.tok, path)[1] if eod_id is None else eod_id
        except TokenizerError as e:
            raise RecipeError(f"data.tokenizer: {e}".replace("--eod-token TOKEN", "data.eod_id=ID")) from None
        self.path = path
        self.vocab_size = self.tok.get_vocab_size()
        self.eod = int(eod)
        self.sha = tokenizer_id(path)
        # GPTDataset's description (and so the dataset identity a cache records) includes this.
        self.unique_identifiers = {"class": "tokenizers", "sha256": self.sha, "vocab_size": self.vocab_size}

    @property
    def pad(self) -> int:
        return -1  # no pad token: Megatron masks nothing it should not

    def encode(self, text: str) -> list:
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))


class MockTokenizer:
    def __init__(self, vocab_size: int, eod_id: int | None = None):
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1 if eod_id is None else int(eod_id)
        self.pad = -1
        self.sha = "mock"
        self.unique_identifiers = {"class": "mock", "vocab_size": self.vocab_size, "eod": self.eod}


def load_tokenizer(d: DataConfig):
    """The tokenizer of the data section and the unpadded vocabulary size the models and cache use."""
    if d.tokenizer:
        tok = FileTokenizer(d.tokenizer, d.eod_id)
        if d.vocab_size is not None and d.vocab_size != tok.vocab_size:
            raise RecipeError(f"data.vocab_size={d.vocab_size} but the tokenizer {d.tokenizer} has "
                              f"{tok.vocab_size} ids; drop data.vocab_size or fix it")
        return tok
    return MockTokenizer(d.vocab_size, d.eod_id)


def _blend(path):
    from megatron.core.datasets.utils import get_blend_from_list
    paths = [str(x) for x in ([path] if isinstance(path, str) else path)]
    for _, p in data_sources(path):
        _check_prefix(p)
    return get_blend_from_list(paths)


def _is_number(s) -> bool:
    try:
        float(s)
        return True
    except (TypeError, ValueError):
        return False


MIXTURE_SHAPE = "a mixture lists weight, prefix pairs, e.g. data.path=[0.7,PREFIX_A,0.3,PREFIX_B]"


def data_sources(path) -> list:
    """[(weight or None, prefix)] of a data.path: one prefix, a list of prefixes, or weight, prefix pairs
    ([w1, prefix1, w2, prefix2, ...]); RecipeError naming the entry when the list has another shape or a weight
    is no finite number > 0."""
    if path is None:
        return []
    if isinstance(path, str):
        return [(None, path)]
    items = list(path)
    shown = "[" + ",".join(str(x) for x in items) + "]"
    if not items:
        raise RecipeError("data.path=[] names no data; give a .bin/.idx prefix (`megatron-kd data prepare` writes "
                          "one), or " + MIXTURE_SHAPE)
    if not _is_number(items[0]):
        numbers = [i for i, x in enumerate(items) if _is_number(x)]
        if numbers:
            raise RecipeError(f"data.path={shown}: entry {numbers[0]} ({items[numbers[0]]}) is a number where a "
                              f"prefix stands; {MIXTURE_SHAPE}")
        return [(None, str(x)) for x in items]
    if len(items) % 2:
        raise RecipeError(f"data.path={shown} has {len(items)} entries, an odd count; {MIXTURE_SHAPE}")
    out = []
    for i in range(0, len(items), 2):
        w, prefix = items[i], items[i + 1]
        if not _is_number(w) or _is_number(prefix):
            bad, want = (i, "weight") if not _is_number(w) else (i + 1, "prefix")
            raise RecipeError(f"data.path={shown}: entry {bad} ({items[bad]}) should be a {want}; {MIXTURE_SHAPE}")
        w = float(w)
        if not (math.isfinite(w) and w > 0):
            raise RecipeError(f"data.path={shown}: the weight {w} of {prefix} must be a finite number > 0 (a "
                              "source of weight 0: leave it out); " + MIXTURE_SHAPE)
        out.append((w, str(prefix)))
    return out


def _check_prefix(p: str) -> None:
    from .corpus import moving_marker
    if os.path.exists(moving_marker(p)):
        raise RecipeError(f"data.path: {p}'s .bin / .idx / .json may be part of two prepares (a `megatron-kd data "
                          f"prepare --output-prefix {p}` was stopped while moving its outputs into place); rerun that "
                          "prepare, which finishes the move first")
    if os.path.isfile(p + ".bin") and os.path.isfile(p + ".idx"):
        return
    stem, ext = os.path.splitext(p)
    if ext in (".bin", ".idx") and os.path.isfile(stem + ".bin") and os.path.isfile(stem + ".idx"):
        raise RecipeError(f"data.path: {p} ends in {ext}, but data.path takes the prefix of the .bin/.idx pair; "
                          f"give data.path={stem}")
    raise RecipeError(f"data.path: {p}.bin / {p}.idx not found; write them with `megatron-kd data prepare "
                      f"--output-prefix {p} ...`")


SPLIT_NAMES = ("train", "valid", "test")


def split_parts(split, num_documents: int) -> list:
    """Documents in each part of data.split for a corpus of num_documents (data.corpus.split_documents, the one
    reading of a split); RecipeError naming data.split when it is no split or gives training no share."""
    from ..errors import CorpusError
    from .corpus import split_documents
    try:
        parts = split_documents(num_documents, str(split))
    except CorpusError:
        raise RecipeError(f"data.split={split!r}: give up to three non-negative shares train,valid,test separated "
                          "by commas, e.g. data.split='969,30,1'") from None
    if parts[0] is None:
        raise RecipeError(f"data.split={split!r} gives training no share; e.g. data.split='969,30,1'")
    return parts


def check_data_path(d: DataConfig) -> list:
    """data.path's shape, its files and its sources' names, before anything reads them; returns data_sources."""
    if d.kind != "indexed":
        return []
    split_parts(d.split, 1)
    sources = data_sources(d.path)
    for _, p in sources:
        _check_prefix(p)
    names = [source_name(p) for _, p in sources]
    if sources and sources[0][0] is not None and len(set(names)) != len(names):
        raise RecipeError(f"data.path blends sources of one name ({', '.join(names)}): each source's cache is "
                          "kd.cache/<file name>; give the .bin/.idx files distinct names")
    return sources


def check_data_split(d: DataConfig) -> None:
    """A data.split that leaves no split with a share empty: megatron-core counts epochs over a split of no
    document without end (also one no sample is asked of)."""
    if d.kind != "indexed":
        return
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    for _, p in data_sources(d.path):
        n = len(IndexedDataset(p, mmap=True).sequence_lengths)
        for name, count in zip(SPLIT_NAMES, split_parts(d.split, n)):
            if count == 0:
                fix = f"data.split='{n - 1},1,0'" if n > 1 else "data.split='100,0,0'"
                raise RecipeError(f"data.split={d.split} gives the {name} split of data.path {p} none of its {n} "
                                  f"documents; set {fix} (or another split giving each share a document), or add "
                                  "documents")


def mixture_sources(d: DataConfig) -> list:
    """[(weight, prefix)] of a data.path that blends several datasets with weights ([w1, prefix1, w2, prefix2,
    ...]); [] for one dataset."""
    if d.kind != "indexed" or isinstance(d.path, str) or d.path is None:
        return []
    sources = data_sources(d.path)
    return sources if len(sources) > 1 and sources[0][0] is not None else []


def _config(d: DataConfig, tokenizer, blend):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    cache = d.index_cache
    if cache is None and d.kind != "mock":
        first = d.path if isinstance(d.path, str) else [p for p in d.path if not _is_number(p)][0]
        cache = os.path.join(os.path.dirname(os.path.abspath(str(first))), "index_cache")
    return GPTDatasetConfig(
        random_seed=d.seed, sequence_length=d.seq_length, blend=blend, split=d.split, tokenizer=tokenizer,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=False, path_to_cache=cache)


def build_datasets(d: DataConfig, tokenizer, train_samples: int, valid_samples: int):
    """(train, valid) Megatron GPTDatasets (valid may be None when the split leaves it no documents); a
    weighted data.path gives a Mixture of its sources (build_mixture)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    mock = d.kind == "mock"
    if mock:  # MockGPTDataset keeps its index in memory and says so once per split
        logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)
    if mixture_sources(d):
        return build_mixture(d, tokenizer, train_samples, valid_samples)
    cfg = _config(d, tokenizer, None if mock else _blend(d.path))
    cls = MockGPTDataset if mock else GPTDataset
    train, valid, _ = BlendedMegatronDatasetBuilder(cls, [train_samples, valid_samples, 0], lambda: True,
                                                    cfg).build()
    if valid is not None and len(valid) >= valid_samples > 0:
        valid = Head(valid, valid_samples)
    return Head(train, train_samples), valid


def build_mixture(d: DataConfig, tokenizer, train_samples: int, valid_samples: int):
    """(train, valid) Mixtures: megatron-core's BlendedDataset over one GPTDataset per source.

    Each source's dataset is built for the run's whole sample count, whatever the weights: its samples, their
    order and so its teacher cache (kd.cache/<source name>, keyed by the source's own sample index) do not
    depend on the weights; a weight only changes which source sample each mixture sample is."""
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    sources = mixture_sources(d)
    names = [source_name(p) for _, p in sources]
    weights = [w for w, _ in sources]  # checked (check_data_path): finite and > 0, distinct names
    splits = []
    for _, prefix in sources:
        cfg = _config(d, tokenizer, _blend(prefix))
        splits.append(BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, max(valid_samples, 1), 0],
                                                    lambda: True, cfg).build())
    cfg = _config(d, tokenizer, _blend(d.path))
    out = []
    for k, n in ((0, train_samples), (1, valid_samples)):
        parts = [sp[k] for sp in splits]
        if n <= 0 or any(p is None for p in parts):
            out.append(None)
            continue
        blend = BlendedDataset(parts, weights, n, cfg)  # never draws past sample n - 1 of a source
        out.append(Mixture(blend, [Head(p, n) for p in parts], names))
    return out[0], out[1]


def source_name(prefix: str) -> str:
    """A mixture source's name: its .bin/.idx file name (kd.cache/<name> is its teacher cache)."""
    return os.path.basename(str(prefix).rstrip("/"))


class Mixture(torch.utils.data.Dataset):
    """Sample i of a blend of sources: source `which(i)[0]`'s sample `which(i)[1]` (megatron-core's
    BlendedDataset decides the pairs from the weights). `with_sources(sets)` reads each source's sample from
    sets[j] instead (the source with its teacher cache), so sample i carries that cache's rows."""

    def __init__(self, blend, sources: list, names: list, sets: list | None = None):
        self.blend, self.sources, self.names = blend, sources, names
        self.sets = sets or sources
        self.unique_description_hash = getattr(blend, "unique_description_hash", "")

    def __len__(self):
        return len(self.blend)

    def which(self, i: int) -> tuple:
        return int(self.blend.dataset_index[i]), int(self.blend.dataset_sample_index[i])

    def with_sources(self, sets: list) -> "Mixture":
        return Mixture(self.blend, self.sources, self.names, sets)

    def __getitem__(self, i):
        j, k = self.which(i)
        return self.sets[j][k]


class Head(torch.utils.data.Dataset):
    """The first n samples of a dataset (GPTDataset rounds up to whole epochs; a cache covers what is used)."""

    def __init__(self, dataset, n: int):
        if len(dataset) < n:
            raise RecipeError(f"the dataset yields {len(dataset)} samples, the run needs {n}; add data (data.path) "
                              "or lower train.iters / train.global_batch_size")
        self.dataset, self.n = dataset, n
        self.unique_description_hash = getattr(dataset, "unique_description_hash", "")

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} outside the first {self.n}")
        return self.dataset[i]


def dataset_id(ds) -> str:
    return str(getattr(ds, "unique_description_hash", ""))


class MegatronSampler(torch.utils.data.Sampler):
    """Micro-batches of this DP rank, from global sample `start` on, in Megatron-LM's pretraining order."""

    def __init__(self, total: int, start: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.total, self.start, self.mbs, self.dp_rank, self.dp_size = total, start, micro_batch_size, dp_rank, dp_size

    def __len__(self):
        return max(0, (self.total - self.start) // (self.mbs * self.dp_size))

    def __iter__(self):
        group = self.mbs * self.dp_size
        for a in range(self.start, self.total - group + 1, group):
            first = a + self.dp_rank * self.mbs
            yield list(range(first, first + self.mbs))


def collate(samples: list) -> dict:
    out = {}
    for k in samples[0]:
        v = [s[k] for s in samples]
        if torch.is_tensor(v[0]):
            out[k] = torch.stack(v)
    return out


def loader(dataset, total: int, start: int, micro_batch_size: int, dp_rank: int, dp_size: int, workers: int = 0):
    """An iterator of micro-batch dicts ([b, s] and [b, s, K] tensors) for this DP rank."""
    sampler = MegatronSampler(total, start, micro_batch_size, dp_rank, dp_size)
    return iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                                            num_workers=workers, persistent_workers=False))


def samples_needed(t: TrainConfig, d: DataConfig):
    """(train samples, valid samples): what the run consumes, so the dataset and the cache are sized to it."""
    valid = d.eval_samples if d.eval_samples is not None else t.eval_iters * t.global_batch_size
    return t.iters * t.global_batch_size, valid


def check_cache(reader, kd: KDConfig, d: DataConfig, train_ds, vocab_size: int, needed: int) -> list:
    """Everything about the cache that can be wrong, before any training step. Returns notes (warnings)."""
    from ..cache import CacheError
    notes = []
    try:
        captured = kd.capture_temperature  # re-tempering
        reader.check_compatible(vocab_size=vocab_size, top_k=kd.top_k, temperature=captured,
                                seq_length=d.seq_length, keys=CACHE_FIELD_KEYS, tail=kd.tail,
                                divergence=kd.divergence, train_temperature=kd.temperature)
    except CacheError as e:
        raise RecipeError(f"kd.cache={kd.cache}: {e}") from None
    if len(reader) < needed:
        raise RecipeError(f"kd.cache={kd.cache} holds {len(reader)} samples, the run needs {needed} "
                          "(train.iters x train.global_batch_size); lower train.iters, or point kd.cache at a new "
                          f"directory with kd.build_cache=true (it builds the {needed} samples)")
    want = dataset_id(train_ds)
    got = str(reader.manifest.get("dataset", ""))
    # A few samples' token hashes decide: the dataset description also changes with the sample count.
    probe = sorted({0, needed // 2, needed - 1})
    for i in probe:
        tokens = train_ds[i]["tokens"]
        if reader.token_hash(i) != _token_hash(tokens):
            raise RecipeError(
                f"kd.cache={kd.cache} was built for another dataset: sample {i}'s tokens differ from the ones the "
                f"teacher saw (cache dataset id {got or '?'}, this run's {want}). Use the data settings of the cache "
                "build (data.path, data.tokenizer, data.seq_length, data.seed, data.split, train.iters x "
                "train.global_batch_size) or rebuild the cache for this data.")
    if got and got != want:
        notes.append(f"kd.cache dataset id {got} differs from this run's {want} (other sample count?); the "
                     f"token hashes of samples {probe} match, so training uses it")
    return notes


def _token_hash(tokens) -> str:
    from ..cache.hashing import hex64, token_hash
    return hex64(token_hash(tokens))


def with_cache(train_ds, reader, kd: KDConfig):
    from ..cache import TopKDataset
    return TopKDataset(train_ds, reader, check_tokens=kd.check_tokens, top_k=kd.top_k)


def source_caches(kd: KDConfig, mixture) -> list:
    """The kd section of each source of a mixture: kd.cache/<source name> its cache."""
    import dataclasses
    return [dataclasses.replace(kd, cache=os.path.join(kd.cache, name)) for name in mixture.names]
