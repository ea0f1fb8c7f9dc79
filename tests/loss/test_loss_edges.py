"""Edge inputs: masked teacher log-probs, a teacher whose top-K is the whole vocabulary, auto impl under TP."""
import pytest
import torch
import torch.distributed as dist

import megatron_kd.loss.api as api
from megatron_kd import topk_kl_loss
from dist_utils import run_ranks
from reference import make_inputs, reference_loss


@pytest.mark.parametrize("impl", ["dense", "chunked", "forward_chunked"])
def test_minus_inf_logprob_is_an_empty_slot(impl):
    inp = make_inputs(n_shape=(6,), V=30, K=5, seed=3)
    lp = inp["logp"].clone()
    lp[:, -1] = float("-inf")  # a teacher that masked these ids
    ids_empty = inp["ids"].clone()
    ids_empty[:, -1] = -1
    a = topk_kl_loss(inp["hidden"], inp["weight"], inp["ids"], lp, impl=impl, chunk_size=4, tail="bucket")
    b = topk_kl_loss(inp["hidden"], inp["weight"], ids_empty, lp, impl=impl, chunk_size=4, tail="bucket")
    assert torch.isfinite(a) and a.item() == pytest.approx(b.item(), rel=1e-12)


def test_nan_logprob_at_a_real_id_is_an_error():
    inp = make_inputs(n_shape=(4,), V=20, K=3, seed=1)
    lp = inp["logp"].clone()
    lp[inp["ids"] >= 0] = float("nan")
    with pytest.raises(ValueError, match="topk_logprobs has NaN"):
        topk_kl_loss(inp["hidden"], inp["weight"], inp["ids"], lp)


@pytest.mark.parametrize("impl", ["dense", "chunked", "forward_chunked"])
def test_bucket_with_the_whole_vocabulary_stays_finite(impl):
    V = 16
    inp = make_inputs(n_shape=(5,), V=V, K=V, seed=2, empty_frac=0.0)
    h = inp["hidden"].float().requires_grad_(True)
    w = inp["weight"].float().requires_grad_(True)
    loss = topk_kl_loss(h, w, inp["ids"], inp["logp"].float(), impl=impl, tail="bucket", chunk_size=2)
    loss.backward()
    full = reference_loss(inp["hidden"], inp["weight"], inp["ids"], inp["logp"].double(), tail="none")
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    assert loss.item() == pytest.approx(full.item(), rel=1e-4)  # nothing outside the top-K: bucket == none


def _auto_same_on_all_ranks(rank, world):
    api.DENSE_AUTO_LIMIT = 1000  # make the dense/chunked boundary fall between the ranks' local shard sizes
    V, Vpad = 100, 128            # the last rank holds fewer valid rows
    inp = make_inputs(n_shape=(12,), V=Vpad, K=4, seed=5)
    inp["ids"] = inp["ids"].masked_fill(inp["ids"] >= V, -1)
    vl = Vpad // world
    w = inp["weight"][rank * vl:(rank + 1) * vl].clone().requires_grad_(True)
    h = inp["hidden"].clone().requires_grad_(True)
    loss = topk_kl_loss(h, w, inp["ids"], inp["logp"], tp_group=dist.group.WORLD, valid_vocab_size=V, chunk_size=4)
    loss.backward()
    ref = reference_loss(inp["hidden"], inp["weight"], inp["ids"], inp["logp"], valid_vocab_size=V)
    assert abs(loss.item() - ref.item()) <= 1e-9 * abs(ref.item())


@pytest.mark.slow
def test_auto_picks_the_same_impl_on_every_tp_rank():
    run_ranks(2, _auto_same_on_all_ranks)
