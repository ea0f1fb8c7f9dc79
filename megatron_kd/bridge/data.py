"""Cache rows next to Bridge's training samples: build the user's datasets as Bridge would, wrap the train split
with the cache's TopKDataset. The Bridge DatasetProvider subclass lives in provider.py, imported only when a
Bridge config is wrapped."""
import dataclasses
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


def wrap_dataset_config(base, kd):
    """cfg.dataset -> a provider that builds it as before and adds the cache rows to the train split."""
    from .provider import OfflineKDDatasetProvider  # imports Bridge

    # The dataloader settings (workers, sharding, pinning, ...) stay the user's: copy the ones both have.
    names = {f.name for f in dataclasses.fields(OfflineKDDatasetProvider) if f.init} - {"base", "kd"}
    loader = {k: getattr(base, k) for k in names if hasattr(base, k)}
    return OfflineKDDatasetProvider(base=base, kd=kd, **loader)
