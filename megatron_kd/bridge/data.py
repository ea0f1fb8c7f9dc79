"""Cache rows next to Bridge's training samples: the dataset wrapper and the dataset-building glue. The Bridge
DatasetProvider subclass lives in provider.py, imported only when a Bridge config is wrapped."""
import dataclasses
import functools
import inspect

import torch

class CachedTopKDataset(torch.utils.data.Dataset):
    """Sample i of `dataset` (a dict: tokens, labels, loss_mask, position_ids, ...) plus row i of the teacher
    cache: topk_ids int64 [S, K] (-1 = empty slot) and topk_logprobs float32 [S, K].

    The cache is built over the same dataset (same config, seed and sample count), so indices line up; with
    check_tokens each sample's token hash is compared with the cache's, which catches any drift."""

    def __init__(self, dataset, reader, check_tokens: bool = True):
        if len(reader) < len(dataset):
            raise ValueError(f"the teacher cache has {len(reader)} samples but the training dataset needs "
                             f"{len(dataset)}: build the cache over at least train_iters * global_batch_size samples")
        self.dataset, self.reader, self.check_tokens = dataset, reader, check_tokens

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        item = dict(self.dataset[i])
        if self.check_tokens:
            self.reader.check_tokens(int(i), item["tokens"])
        rows = self.reader[int(i)]
        item["topk_ids"] = torch.as_tensor(rows["topk_ids"], dtype=torch.int64)
        item["topk_logprobs"] = torch.as_tensor(rows["topk_logprobs"], dtype=torch.float32)
        return item


def bind_provider(provider, tokenizer=None, pg_collection=None):
    """Bridge's dataset provider functions take tokenizer / pg_collection only when they declare them."""
    params = inspect.signature(provider).parameters
    if "tokenizer" in params:
        provider = functools.partial(provider, tokenizer=tokenizer)
    if "pg_collection" in params:
        provider = functools.partial(provider, pg_collection=pg_collection)
    return provider


def build_kd_datasets(base, reader, context, provider, check_tokens: bool = True):
    """Build the user's train/valid/test datasets with Bridge's provider; wrap the train split with the cache."""
    provider = bind_provider(provider, getattr(context, "tokenizer", None), getattr(context, "pg_collection", None))
    sizes = [context.train_samples, context.valid_samples, context.test_samples]
    train, valid, test = provider(sizes, base)
    if train is not None:
        train = CachedTopKDataset(train, reader() if callable(reader) else reader, check_tokens)
    return train, valid, test


def wrap_dataset_config(base, kd):
    """cfg.dataset -> a provider that builds it as before and adds the cache rows to the train split."""
    from .provider import OfflineKDDatasetProvider  # imports Bridge

    # The dataloader settings (workers, sharding, pinning, ...) stay the user's: copy the ones both have.
    names = {f.name for f in dataclasses.fields(OfflineKDDatasetProvider) if f.init} - {"base", "kd"}
    loader = {k: getattr(base, k) for k in names if hasattr(base, k)}
    return OfflineKDDatasetProvider(base=base, kd=kd, **loader)
