"""Data flow pieces: Megatron-LM's sample order across DP ranks, the context-parallel split of cache rows
(Megatron's load-balanced split: rows follow their tokens), the run-length view of a GPTDataset."""
import pytest
import torch

from megatron_kd.data.datasets import Head, MegatronSampler
from megatron_kd.training.step import next_batch


def test_sampler_matches_megatron_pretraining_order():
    # GBS 8 = micro 2 x DP 2 x 2 micro-batches: groups of 4 samples, rank r takes its 2
    per_rank = [list(MegatronSampler(16, 0, 2, r, 2)) for r in range(2)]
    assert per_rank[0] == [[0, 1], [4, 5], [8, 9], [12, 13]]
    assert per_rank[1] == [[2, 3], [6, 7], [10, 11], [14, 15]]
    assert list(MegatronSampler(16, 8, 2, 1, 2)) == [[10, 11], [14, 15]]  # resumed after one global batch
    everything = sorted(i for r in per_rank for mb in r for i in mb)
    assert everything == list(range(16))


class FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.fixture()
def one_process_group():
    import os
    import torch.distributed as dist
    from megatron_kd.runtime.dist import free_port
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_context_parallel_split_keeps_cache_rows_with_their_tokens(one_process_group):
    b, s, k, cp = 2, 16, 3, 2
    tokens = torch.arange(b * s).reshape(b, s)
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(b, s),
             "position_ids": torch.arange(s).expand(b, s), "topk_ids": tokens[..., None] * 10 + torch.arange(k),
             "topk_logprobs": tokens[..., None].float().expand(b, s, k)}
    seen = []
    for r in range(cp):
        part = next_batch(iter([dict(batch)]), "cpu", FakeGroup(cp, r))
        chunks = s // (2 * cp)
        # Megatron's load-balanced split: rank r keeps chunks r and 2*cp-1-r of the sequence
        want_pos = list(range(r * chunks, (r + 1) * chunks)) + list(range((2 * cp - 1 - r) * chunks,
                                                                           (2 * cp - r) * chunks))
        assert part["position_ids"][0].tolist() == want_pos
        assert torch.equal(part["topk_ids"], part["tokens"][..., None] * 10 + torch.arange(k))
        assert torch.equal(part["topk_logprobs"][..., 0], part["tokens"].float())
        assert torch.equal(part["labels"], part["tokens"] + 1)
        seen += part["tokens"][0].tolist()
    assert sorted(seen) == tokens[0].tolist()


def test_head_view_keeps_the_dataset_identity():
    class DS:
        unique_description_hash = "abc"

        def __len__(self):
            return 10

        def __getitem__(self, i):
            return i

    h = Head(DS(), 4)
    assert len(h) == 4 and h[3] == 3 and h.unique_description_hash == "abc"
    with pytest.raises(IndexError):
        h[4]
    from megatron_kd.recipe.schema import RecipeError
    with pytest.raises(RecipeError, match="the run needs 11"):
        Head(DS(), 11)
