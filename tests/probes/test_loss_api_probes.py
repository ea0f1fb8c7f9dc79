"""Adversarial `topk_kl_loss` inputs: teacher probabilities that are no sub-distribution, one id twice in a
position's top-K, NaN / inf, negative or NaN loss weights. Each raises ValueError in one sentence naming the
argument, before any loss is computed."""
import math

import pytest
import torch

from megatron_kd import topk_kl_loss

V, H, N, K = 32, 8, 6, 4


def inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    logp = torch.log_softmax(torch.randn(N, V, generator=g, dtype=torch.float64), -1).gather(1, ids)
    return hidden, weight, ids, logp


def refused(*names, **kw):
    hidden, weight, ids, logp = inputs()
    args = dict(hidden=hidden, weight=weight, topk_ids=ids, topk_logprobs=logp)
    args.update({k: v(args) if callable(v) else v for k, v in kw.items()})
    with pytest.raises(ValueError) as e:
        topk_kl_loss(args.pop("hidden"), args.pop("weight"), args.pop("topk_ids"), args.pop("topk_logprobs"), **args)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in names), msg
    return msg


def test_teacher_probabilities_summing_far_above_one():
    # log(0.9) at every slot: 3.6 of probability in one position
    refused("topk_logprobs", topk_logprobs=lambda a: torch.full_like(a["topk_logprobs"], math.log(0.9)))


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_one_id_twice_within_a_position(impl):
    def dup(a):
        ids = a["topk_ids"].clone()
        ids[2, 1] = ids[2, 0]
        return ids
    msg = refused("topk_ids", topk_ids=dup, impl=impl)
    assert "twice" in msg or "duplicate" in msg


def test_an_empty_slot_repeated_is_no_duplicate():
    hidden, weight, ids, logp = inputs()
    ids[:, 2:] = -1
    assert torch.isfinite(topk_kl_loss(hidden, weight, ids, logp))


def test_probabilities_at_rounding_above_one_are_taken():
    """A cache stores fp16 log-probs: a full-mass top-K may sum a little above 1, which is no error."""
    hidden, weight, ids, _ = inputs()
    logp = torch.log_softmax(torch.randn(N, K, dtype=torch.float64), -1).half().double() + 2e-4
    assert torch.isfinite(topk_kl_loss(hidden, weight, ids, logp))


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_nan_hidden_or_weight_rows_give_no_silent_nan(value):
    # -inf log-probs are empty slots (allowed); NaN is refused
    if value != value:
        refused("topk_logprobs", topk_logprobs=lambda a: a["topk_logprobs"].index_fill(0, torch.tensor([1]), value))
    else:
        hidden, weight, ids, logp = inputs()
        logp[1] = value
        assert torch.isfinite(topk_kl_loss(hidden, weight, ids, logp))


@pytest.mark.parametrize("key,value", [("kl_weight", -1.0), ("kl_weight", float("nan")), ("ce_weight", -0.5),
                                       ("ce_weight", float("inf")), ("temperature", float("nan"))])
def test_a_negative_or_nan_weight(key, value):
    hidden, weight, ids, logp = inputs()
    labels = torch.zeros(N, dtype=torch.long)
    with pytest.raises(ValueError) as e:
        topk_kl_loss(hidden, weight, ids, logp, labels=labels, **{key: value})
    assert key in str(e.value) and "\n" not in str(e.value), str(e.value)
