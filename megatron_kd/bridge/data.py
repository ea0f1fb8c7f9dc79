"""Cache rows next to Bridge's training samples: build the user's datasets as Bridge would, keep the first
train_samples of the train split (what the run consumes: Bridge's GPTDataset rounds up to whole epochs) and add
the cache's rows to them. Nothing here imports Bridge; the Bridge DatasetProvider subclass is provider.py."""
import functools
import inspect


def bind_provider(provider, tokenizer=None, pg_collection=None):
    """Bridge's dataset provider functions take tokenizer / pg_collection only when they declare them."""
    params = inspect.signature(provider).parameters
    if "tokenizer" in params:
        provider = functools.partial(provider, tokenizer=tokenizer)
    if "pg_collection" in params:
        provider = functools.partial(provider, pg_collection=pg_collection)
    return provider


def build_base_datasets(base, context, provider):
    """(train, valid, test) exactly as Bridge builds them for `base`: its provider, its sample counts."""
    provider = bind_provider(provider, getattr(context, "tokenizer", None), getattr(context, "pg_collection", None))
    return provider([context.train_samples, context.valid_samples, context.test_samples], base)


def train_head(train, train_samples: int):
    """The first `train_samples` samples of Bridge's train split: sample i is Bridge's sample i."""
    from ..data.datasets import Head
    n = int(train_samples)
    if len(train) < n:
        raise ValueError(f"the train split yields {len(train)} samples, the run needs {n} (train.train_iters x "
                         "train.global_batch_size); add data (dataset.blend) or lower train.train_iters")
    return Head(train, n)


def kd_train_split(train, kd, train_samples: int, reader=None):
    """Bridge's train samples [0, train_samples) with the teacher rows of kd's cache (row i <-> sample i, token
    hashes checked per sample). The cache must cover what the run consumes, not the split's whole epoch."""
    from ..cache import CacheReader, TopKDataset
    head = train_head(train, train_samples)
    reader = reader if reader is not None else CacheReader(kd.cache)
    if len(reader) < len(head):
        raise ValueError(f"kd.cache={kd.cache!r} holds {len(reader)} samples, the run needs {len(head)} "
                         "(train.train_iters x train.global_batch_size); rebuild it for this recipe with `python -m "
                         "megatron_kd.bridge.cache build --recipe ... --config-file ...` or lower train.train_iters")
    return TopKDataset(head, reader, check_tokens=kd.check_tokens, top_k=kd.top_k)


def build_kd_datasets(base, kd, context, provider):
    """Train/valid/test from Bridge's provider for `base`; the train split gets the teacher rows of `kd`'s cache.
    Validation and test stay plain LM batches."""
    train, valid, test = build_base_datasets(base, context, provider)
    if train is not None:
        train = kd_train_split(train, kd, context.train_samples)
    return train, valid, test
