"""TopKDataset: a token dataset's samples plus the cached teacher top-K, shaped like Megatron GPT batches.

Data flow: every rank (each TP, CP and DP rank) reads its own rows from the memory-mapped cache; there is no
broadcast from TP rank 0. The loss needs the same [b, s, K] targets on every TP rank, so a broadcast would
move the same bytes over the interconnect that a read moves from the page cache, plus a collective that
stalls every TP rank on rank 0's loader. Reads are O(1) per sample and need no coordination.
"""
import numpy as np
import torch

from .reader import CacheReader

GPT_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _as_tensor(x, dtype):
    if torch.is_tensor(x):
        return x.to(dtype)
    return torch.as_tensor(np.array(x), dtype=dtype)  # a copy: memmap rows are read-only


def split_sample(sample) -> dict:
    """A token dataset's sample -> dict with tokens/labels/loss_mask/position_ids (torch) plus any extra keys.

    Accepts Megatron GPTDataset dicts (tokens, labels, loss_mask, position_ids, ...) or a 1-D sequence of
    seq_length + 1 token ids (tokens = x[:-1], labels = x[1:]).
    """
    if isinstance(sample, dict):
        if "tokens" not in sample:
            raise ValueError(f"a dict sample needs a 'tokens' entry (Megatron GPTDataset style), got keys {list(sample)}")
        out = dict(sample)
        tokens = _as_tensor(sample["tokens"], torch.int64)
        if "labels" not in sample:
            raise ValueError("a dict sample needs 'labels' (tokens shifted by one) to align the teacher's rows")
    else:
        x = _as_tensor(sample, torch.int64).reshape(-1)
        if x.numel() < 2:
            raise ValueError("a sample must hold seq_length + 1 token ids (tokens and the next-token labels)")
        out = {"tokens": x[:-1], "labels": x[1:]}
        tokens = out["tokens"]
    out["tokens"] = tokens
    out["labels"] = _as_tensor(out["labels"], torch.int64)
    s = tokens.shape[-1]
    out["loss_mask"] = (_as_tensor(out["loss_mask"], torch.float32) if out.get("loss_mask") is not None
                        else torch.ones(s, dtype=torch.float32))
    out["position_ids"] = (_as_tensor(out["position_ids"], torch.int64) if out.get("position_ids") is not None
                           else torch.arange(s, dtype=torch.int64))
    return out


class TopKDataset(torch.utils.data.Dataset):
    """Sample i = token_dataset[i] (Megatron GPT keys) + topk_ids [S, K] int64 + topk_logprobs [S, K] float32.

    Row t of the top-K is the teacher's distribution of token t + 1 given tokens[:t + 1], aligned with labels[t].
    top_k < the cache's K keeps the first top_k entries (the most probable).
    expected_teacher: refuse a cache from another teacher (see CacheReader).
    precheck_bytes: when the cache rows this dataset reads total at most this many bytes, their crc32s are checked
    here, so a corrupt shard is refused before the first training step (else at its first read).
    """

    def __init__(self, token_dataset, reader, *, check_tokens: bool = True, top_k: int | None = None,
                 expected_teacher=None, precheck_bytes: int = 4 << 30):
        self.data = token_dataset
        self.reader = reader if isinstance(reader, CacheReader) else CacheReader(reader)
        self.reader.check_teacher(expected_teacher)
        self.check_tokens = check_tokens
        self.reader.check_compatible(top_k=top_k)
        self.top_k = top_k
        if len(token_dataset) > len(self.reader):
            raise ValueError(f"the token dataset has {len(token_dataset)} samples, the cache only "
                             f"{len(self.reader)}; build the cache with --num-samples {len(token_dataset)} or "
                             "train on fewer samples")
        if self.reader.verify_reads and len(token_dataset) * self.reader.sample_bytes <= precheck_bytes:
            self.reader.check_samples(len(token_dataset))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i) -> dict:
        out = split_sample(self.data[i])
        if self.check_tokens:
            self.reader.check_tokens(i, out["tokens"])
        rows = self.reader[i]
        ids, lp = rows["topk_ids"], rows["topk_logprobs"]
        if self.top_k is not None:
            ids, lp = ids[:, :self.top_k], lp[:, :self.top_k]
        out["topk_ids"] = torch.from_numpy(np.ascontiguousarray(ids))
        out["topk_logprobs"] = torch.from_numpy(np.ascontiguousarray(lp))
        return out


def collate_topk(samples: list[dict]) -> dict:
    """Stack samples into a batch: [B, S] for GPT keys, [B, S, K] for top-K; other tensor keys stacked too."""
    if not samples:
        raise ValueError("collate_topk needs at least one sample")
    out = {}
    for key in samples[0]:
        vals = [s[key] for s in samples]
        out[key] = torch.stack(vals) if torch.is_tensor(vals[0]) else vals
    return out
