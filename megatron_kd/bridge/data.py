"""Cache rows next to Bridge's training samples: build the user's datasets as Bridge would, wrap the train split
with the cache's TopKDataset. The Bridge DatasetProvider subclass (and wrap_dataset_config) live in provider.py,
which imports this module and Bridge, and is imported only when a Bridge config is wrapped."""
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


def build_kd_datasets(base, kd, context, provider):
    """Train/valid/test from Bridge's provider for `base`; the train split gets the teacher rows of `kd`'s cache
    (sample i <-> cache row i, token hashes checked). Validation and test stay plain LM batches."""
    from ..cache import TopKDataset

    provider = bind_provider(provider, getattr(context, "tokenizer", None), getattr(context, "pg_collection", None))
    train, valid, test = provider([context.train_samples, context.valid_samples, context.test_samples], base)
    if train is not None:
        train = TopKDataset(train, kd.cache_path, check_tokens=kd.check_tokens, top_k=kd.top_k)
    return train, valid, test

