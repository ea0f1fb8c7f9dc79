"""vocab_parallel_topk / topk_from_hidden at TP=1, 2, 4 (gloo) against torch.topk(log_softmax) of full logits."""
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from megatron_kd.parallel.topk import topk_from_hidden, vocab_parallel_topk


def _reference(logits, k, temperature=1.0, valid=None):
    z = logits[:, :valid].double() / temperature
    lp = torch.log_softmax(z, dim=-1)
    vals, ids = lp.topk(k, dim=-1)
    return ids, vals


def _check(ids, lp, logits, k, temperature=1.0, valid=None):
    ref_ids, ref_lp = _reference(logits, k, temperature, valid)
    assert ids.dtype == torch.int64 and lp.dtype == torch.float32 and ids.shape == (logits.shape[0], k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-6)


def test_tp1_matches_torch_topk():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(33, 97, generator=g) * 4
    for k, t in ((1, 1.0), (7, 1.0), (97, 1.0), (10, 2.5), (10, 0.5)):
        ids, lp = vocab_parallel_topk(logits, k, temperature=t)
        _check(ids, lp, logits, k, t)
    ids, lp = vocab_parallel_topk(logits, 5, valid_vocab_size=90)  # 7 padding columns
    _check(ids, lp, logits, 5, valid=90)
    assert int(ids.max()) < 90


def test_ties_break_by_smaller_id_and_bf16_logits():
    logits = torch.zeros(4, 20)
    logits[:, [3, 9, 15]] = 2.0
    ids, lp = vocab_parallel_topk(logits, 4)
    assert ids.tolist() == [[3, 9, 15, 0]] * 4
    assert torch.allclose(lp[:, 0], lp[:, 2])
    # bf16 logits: many exact ties. Reference: sort by (value desc, id asc), take the first k.
    z = (torch.randn(16, 64, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    assert len(set(z.float().flatten().tolist())) < z.numel()
    ids, lp = vocab_parallel_topk(z, 12)
    u = torch.log_softmax(z.double(), -1)
    for row in range(z.shape[0]):
        order = sorted(range(64), key=lambda j: (-z[row, j].item(), j))[:12]
        assert ids[row].tolist() == order
    torch.testing.assert_close(lp.double(), u.gather(1, ids), rtol=0, atol=2e-6)


def test_topk_from_hidden_chunks_match_dense():
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(50, 16, generator=g), torch.randn(70, 16, generator=g)
    dense = vocab_parallel_topk(h @ w.t(), 8)
    for chunk in (1, 7, 50, 1000):
        ids, lp = topk_from_hidden(h, w, 8, chunk_size=chunk)
        assert torch.equal(ids, dense[0])
        torch.testing.assert_close(lp, dense[1], rtol=0, atol=1e-5)


def test_bad_arguments():
    x = torch.randn(3, 10)
    with pytest.raises(ValueError, match="valid vocabulary"):
        vocab_parallel_topk(x, 11)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_topk(x, 2, temperature=0.0)
    with pytest.raises(ValueError, match="NaN or inf"):
        vocab_parallel_topk(torch.full((2, 4), float("nan")), 2)
    with pytest.raises(ValueError, match="not its transpose"):
        topk_from_hidden(torch.randn(4, 8), torch.randn(8, 10), 2)


def _tp_checks(rank, world, group):
    g = torch.Generator().manual_seed(10 + world)
    v_local = 23
    full = torch.randn(40, v_local * world, generator=g) * 3  # ties-free random logits
    shard = full[:, rank * v_local:(rank + 1) * v_local]
    for k, t in ((1, 1.0), (5, 1.0), (v_local + 4, 1.0), (9, 0.7)):  # k > V_local: candidates from several ranks
        ids, lp = vocab_parallel_topk(shard, k, group, temperature=t)
        _check(ids, lp, full, k, t)
    # Padded vocabulary: the last 30 ids are padding; with world=4 the whole last shard is padding.
    valid = v_local * world - 30
    ids, lp = vocab_parallel_topk(shard, 6, group, valid_vocab_size=valid)
    _check(ids, lp, full, 6, valid=valid)
    # Explicit, uneven shards: rank r holds [starts[r], starts[r+1]).
    cuts = [0] + [v_local * (r + 1) + (3 if r < world - 1 else 0) for r in range(world)]
    ids, lp = vocab_parallel_topk(full[:, cuts[rank]:cuts[rank + 1]], 7, group, vocab_start_index=cuts[rank])
    _check(ids, lp, full, 7)
    # Chunked from hidden states and a vocab-sharded output weight.
    h = torch.randn(30, 8, generator=g)
    w = torch.randn(v_local * world, 8, generator=g)
    ids, lp = topk_from_hidden(h, w[rank * v_local:(rank + 1) * v_local], 5, group, chunk_size=4)
    _check(ids, lp, h @ w.t(), 5)
    # Ties across ranks resolve to the smaller id at every TP size.
    tie = torch.zeros(2, v_local * world)
    tie[:, [1, v_local + 1, v_local * world - 1]] = 5.0
    ids, _ = vocab_parallel_topk(tie[:, rank * v_local:(rank + 1) * v_local], 4, group)
    assert ids.tolist() == [[1, v_local + 1, v_local * world - 1, 0]] * 2


def _tp_worker(rank, world):
    _tp_checks(rank, world, dist.group.WORLD)  # TP=4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # two TP=2 groups: one spawn covers both sizes
    _tp_checks(rank % 2, 2, pairs[rank // 2])


@pytest.mark.slow
def test_vocab_parallel_topk_gloo_tp2_tp4():
    run_ranks(4, _tp_worker)
