"""The wide-row block prefilter of the teacher top-K (topk._block_topk: candidates from the K + slack blocks of 64
ids with the largest maxima) against the plain candidate path (v.topk over the whole row), the whole-row key rule
and a float64 reference, on fresh random logits: ties (coarse grids, constant rows, the top in one block), bf16 /
fp16 / fp32, widths around the threshold and with a partial last block, a padded vocabulary, T != 1, hidden states,
and tensor-parallel shards (gloo, 2 and 4 ranks). broken_variants checks that these checks catch a prefilter
that keeps K blocks instead of K + slack, or reads blocks one column short."""
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from topk_refs import exact, plain, reference
from megatron_kd.parallel import topk as topk_ops
from megatron_kd.parallel.topk import BLOCK, candidates, start_topk, topk_from_hidden, vocab_parallel_topk


def threshold(k):
    """The narrowest row the prefilter takes."""
    w = BLOCK
    while not topk_ops._blocks_pay(w, candidates(k)):
        w += BLOCK
    return w





def logits(g, n, w, dtype, kind):
    """Rows that stress the prefilter: ties everywhere, the top in one block, ties at the K-th value in many
    blocks, the top in the partial last block; plus plain random rows."""
    if kind == "grid":
        x = torch.randint(0, int(torch.randint(2, 40, (1,), generator=g)), (n, w), generator=g).float() / 4
    else:
        x = torch.randn(n, w, generator=g) * 4
    r = torch.randperm(n, generator=g).tolist()
    x[r[0]] = 1.5                                   # constant row: every block ties
    b = int(torch.randint(0, w // BLOCK, (1,), generator=g))
    x[r[1], b * BLOCK:(b + 1) * BLOCK] += 40.0     # the whole top in one block
    x[r[2]] = -3.0                                  # one value per block ties at the K-th value
    x[r[2], ::BLOCK] = 2.0
    x[r[2], 5:9] = 9.0
    x[r[3], -(w % BLOCK or BLOCK):] += 50.0         # the top in the last (partial) block
    x[r[4], BLOCK - 1::BLOCK] += 30.0              # the top in the last column of every block
    return x.to(dtype)


def check_block_topk(v, kk):
    """_block_topk's values are v.topk(kk)'s, and its columns hold them."""
    vals, cols = topk_ops._block_topk(v, kk)
    ref = v.topk(kk, dim=1).values
    assert torch.equal(vals, ref)
    assert torch.equal(v.gather(1, cols), vals)
    assert bool((cols >= 0).all()) and bool((cols < v.shape[1]).all())
    assert all(len(set(row)) == kk for row in cols.tolist())  # distinct columns


def check_all_paths(x, k, temperature=1.0, valid=None, chunk=1):
    """Block path == plain path == whole-row keys (bit for bit), ids == float64 reference. One row per chunk by
    default: a chunk with a tied row is redone over whole rows, which would hide a wrong prefilter on its other
    rows."""
    ids, lp = start_topk(x, k, temperature=temperature, valid_vocab_size=valid, chunk_size=chunk).result()
    p_ids, p_lp = plain(lambda: start_topk(x, k, temperature=temperature, valid_vocab_size=valid,
                                           chunk_size=chunk).result())
    assert torch.equal(ids, p_ids) and torch.equal(lp, p_lp)
    e_ids, e_lp = exact(x, k, temperature, valid)
    assert torch.equal(ids, e_ids) and torch.equal(lp, e_lp)
    r_ids, r_lp = reference(x, k, temperature, valid)
    assert torch.equal(ids, r_ids)
    assert (lp.double() - r_lp).abs().max() < 1e-5


def run_checks(seed, dtype):
    g = torch.Generator().manual_seed(7000 + seed)
    k = int(torch.randint(1, 40, (1,), generator=g))
    kk = candidates(k)
    t = threshold(k)
    for w in (t - 1, t, t + 17, t + BLOCK * 3 + 63):  # just below, at, above, partial last block
        n = int(torch.randint(6, 14, (1,), generator=g))
        x = logits(g, n, w, dtype, "grid" if seed % 2 else "randn")
        if w >= t:
            check_block_topk(x, kk)
        check_all_paths(x, k)
    temp = 0.7
    x = logits(g, 9, t + 40, dtype, "randn")
    check_all_paths(x, k, temperature=temp)
    check_block_topk(x.float() / temp, kk)
    # Padded vocabulary: the last ids are padding (large values that must never appear); v is a strided view
    x = logits(g, 8, t + 3 * BLOCK + 5, dtype, "grid")
    x[:, t + 5:] = 100.0
    check_all_paths(x, k, valid=t + 5)
    check_block_topk(x[:, :t + 5], kk)
    # Several rows per chunk, some chunks redone over whole rows (a constant row ties far beyond the slack)
    check_all_paths(logits(g, 12, t + 9, dtype, "randn"), k, chunk=5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_blocks_equal_plain_path_whole_row_keys_and_fp64(seed, dtype):
    run_checks(seed, dtype)


def test_the_prefilter_runs_only_on_wide_rows(monkeypatch):
    calls = []
    real = topk_ops._block_topk
    monkeypatch.setattr(topk_ops, "_block_topk", lambda v, kk: calls.append(v.shape[1]) or real(v, kk))
    k = 10
    t = threshold(k)
    assert t == 4 * candidates(k) * BLOCK
    vocab_parallel_topk(torch.randn(3, t - 1), k)
    assert calls == []
    vocab_parallel_topk(torch.randn(3, t), k)
    assert calls == [t]


def test_top_k_of_hidden_states():
    g = torch.Generator().manual_seed(3)
    k = 16
    w_rows = threshold(k) + 70
    h = torch.randn(21, 32, generator=g).to(torch.bfloat16)
    w = torch.randn(w_rows, 32, generator=g).to(torch.bfloat16)
    for chunk in (1, 8):
        ids, lp = topk_from_hidden(h, w, k, chunk_size=chunk)
        p_ids, p_lp = plain(topk_from_hidden, h, w, k, chunk_size=chunk)
        assert torch.equal(ids, p_ids) and torch.equal(lp, p_lp)
        logits_ = torch.cat([h[a:a + chunk] @ w.t() for a in range(0, 21, chunk)])
        assert torch.equal(ids, reference(logits_, k)[0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_are_refused(bad):
    k = 4
    x = torch.randn(5, threshold(k) + 10)
    x[2, 1000] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        vocab_parallel_topk(x, k)
    with pytest.raises(ValueError, match="NaN or inf"):
        plain(vocab_parallel_topk, x, k)


def _broken(kind):
    """A prefilter with one mistake: 'k_blocks' keeps K blocks (the kk-th value and the tie flag can be wrong),
    'short_block' reads 63 of each block's 64 columns."""
    def block_topk(v, kk):
        n, width = v.shape
        nb = width // BLOCK
        blocks = v[:, :nb * BLOCK].unflatten(1, (nb, BLOCK))
        keep = kk - 16 if kind == "k_blocks" else kk  # K, for the K < 64 the checks use
        size = BLOCK - 1 if kind == "short_block" else BLOCK
        best = blocks.amax(dim=2).topk(keep, dim=1).indices
        cols = ((best * BLOCK).unsqueeze(2) + torch.arange(size)).flatten(1)
        if nb * BLOCK < width:
            cols = torch.cat([cols, torch.arange(nb * BLOCK, width).expand(n, -1)], dim=1)
        vals, j = v.gather(1, cols).topk(min(kk, cols.shape[1]), dim=1)
        return vals, cols.gather(1, j)
    return block_topk


@pytest.mark.parametrize("kind", ["k_blocks", "short_block"])
def test_the_checks_catch_a_broken_prefilter(monkeypatch, kind):
    monkeypatch.setattr(topk_ops, "_block_topk", _broken(kind))
    with pytest.raises(AssertionError):
        for seed in range(4):
            for dtype in (torch.bfloat16, torch.float32):
                run_checks(seed, dtype)


def _tp_checks(rank, world, group):
    g = torch.Generator().manual_seed(50 + world)
    k = 6
    v_local = threshold(k) + 2 * BLOCK + 11  # every shard wide enough for the prefilter, a partial last block
    for dtype, kind in ((torch.bfloat16, "grid"), (torch.bfloat16, "randn"), (torch.float32, "randn")):
        full = torch.cat([logits(g, 10, v_local, dtype, kind) for _ in range(world)], dim=1)  # each shard's patterns
        check_block_topk(full[:, rank * v_local:(rank + 1) * v_local], candidates(k))
        full[3] = 0.5
        full[3, 7] = 1.0            # a tie far past the slack, over every shard
        mine = full[:, rank * v_local:(rank + 1) * v_local]
        for t in (1.0, 0.7):  # one row per chunk: a tied row's redo covers only itself
            ids, lp = start_topk(mine, k, group, temperature=t, chunk_size=1).result()
            p_ids, p_lp = plain(lambda: start_topk(mine, k, group, temperature=t, chunk_size=1).result())
            assert torch.equal(ids, p_ids) and torch.equal(lp, p_lp)
            r_ids, r_lp = reference(full, k, t)
            assert torch.equal(ids, r_ids) and (lp.double() - r_lp).abs().max() < 1e-5
        valid = v_local * world - v_local // 2  # the last shard half padding
        ids, lp = start_topk(mine, k, group, valid_vocab_size=valid, chunk_size=1).result()
        assert torch.equal(ids, reference(full, k, valid=valid)[0])
        assert torch.equal(ids, plain(vocab_parallel_topk, mine, k, group, valid_vocab_size=valid)[0])


def _tp_worker(rank, world):
    _tp_checks(rank, world, dist.group.WORLD)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # two TP=2 groups: one spawn covers both sizes
    _tp_checks(rank % 2, 2, pairs[rank // 2])


@pytest.mark.slow
def test_tensor_parallel_shards_gloo_tp2_tp4():
    run_ranks(4, _tp_worker)
