"""The teacher top-K's candidate path (topk of K + slack in the logits' dtype, keys of the candidates only, ties
settled by redoing the chunk with whole-row keys) against the whole-row key rule and a float64 reference, on
fresh random logits with many ties (bf16, coarse grids, constant rows), fp32 at T != 1, and shards narrower than K."""
import math

import pytest
import torch

from megatron_kd.parallel import topk as topk_ops
from megatron_kd.parallel.topk import candidates, start_topk, topk_from_hidden, vocab_parallel_topk
from topk_refs import exact, reference




def tied_logits(g, n, v, dtype, levels):
    """Logits on a coarse grid: most rows have ties at their K-th value, some far beyond the slack."""
    x = torch.randint(0, levels, (n, v), generator=g).float() / 4
    x[0] = 1.5                      # a constant row: every id ties
    x[1, : v // 2] = 2.0            # half the row tied at the top
    return x.to(dtype)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_candidates_equal_whole_row_keys_and_fp64(seed, dtype):
    g = torch.Generator().manual_seed(1000 + seed)
    n, v = int(torch.randint(3, 40, (1,), generator=g)), int(torch.randint(20, 700, (1,), generator=g))
    k = int(torch.randint(1, min(v, 60) + 1, (1,), generator=g))
    levels = int(torch.randint(2, 64, (1,), generator=g))
    x = tied_logits(g, n, v, dtype, levels) if seed % 2 else (torch.randn(n, v, generator=g) * 4).to(dtype)
    for t in (1.0, 0.7):
        ids, lp = vocab_parallel_topk(x, k, temperature=t)
        e_ids, e_lp = exact(x, k, t)
        assert torch.equal(ids, e_ids) and torch.equal(lp, e_lp)
        r_ids, r_lp = reference(x, k, t)
        assert torch.equal(ids, r_ids)
        assert (lp.double() - r_lp).abs().max() < 1e-5


def test_ties_beyond_the_slack_take_the_smallest_ids():
    k = 10
    x = torch.zeros(3, 500, dtype=torch.bfloat16)
    x[1, 7] = 1.0  # one clear top, then ties among 499 ids
    x[2, 100:] = -1.0
    ids, lp = vocab_parallel_topk(x, k)
    assert ids[0].tolist() == list(range(k))
    assert ids[1].tolist() == [7] + [i for i in range(k) if i != 7][: k - 1]
    assert ids[2].tolist() == list(range(k))
    assert torch.allclose(lp[0].double(), torch.full((k,), -math.log(500), dtype=torch.float64))


def test_the_tie_fallback_is_taken_only_for_chunks_that_need_it(monkeypatch):
    calls = []
    real = topk_ops._chunk

    def spy(x, k, shard, group, temperature, exact):
        calls.append(exact)
        return real(x, k, shard, group, temperature, exact)

    monkeypatch.setattr(topk_ops, "_chunk", spy)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 300, generator=g)
    x[9] = 0.25  # chunk 2 of 3 (rows 8..11) has a constant row
    ids, lp = start_topk(x, 5, chunk_size=4).result()
    assert calls == [False, False, False, True]
    assert torch.equal(ids, exact(x, 5)[0])
    # breaking the fallback (no redo) gives ids the rule does not pick: the test can fail
    calls.clear()
    monkeypatch.setattr(topk_ops.PendingTopK, "result", lambda self: (self.ids, self.logp))
    bad, _ = start_topk(x, 5, chunk_size=4).result()
    assert not torch.equal(bad[9], exact(x, 5)[0][9]) or candidates(5) >= 300


def test_padding_rows_and_narrow_shards():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 90, generator=g) * 3).to(torch.bfloat16)
    ids, lp = vocab_parallel_topk(x, 30, valid_vocab_size=50)
    r_ids, r_lp = reference(x, 30, valid=50)
    assert ids.max() < 50 and torch.equal(ids, r_ids)
    assert (lp.double() - r_lp).abs().max() < 1e-5
    ids, _ = vocab_parallel_topk(x[:, :12], 12)  # K = the whole shard: no candidates to leave out
    assert torch.equal(ids, reference(x[:, :12], 12)[0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_are_refused_after_the_last_chunk(bad):
    x = torch.randn(10, 64)
    x[7, 3] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        start_topk(x, 4, chunk_size=3).result()


def test_from_hidden_equals_the_logits_path():
    g = torch.Generator().manual_seed(11)
    h, w = torch.randn(37, 16, generator=g).to(torch.bfloat16), torch.randn(333, 16, generator=g).to(torch.bfloat16)
    ids, lp = topk_from_hidden(h, w, 20, chunk_size=8)
    logits = torch.cat([h[a:a + 8] @ w.t() for a in range(0, 37, 8)])
    e_ids, e_lp = exact(logits, 20)
    assert torch.equal(ids, e_ids) and torch.equal(lp, e_lp)
