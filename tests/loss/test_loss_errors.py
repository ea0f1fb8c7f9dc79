"""Bad input: a ValueError that names the argument."""
import pytest
import torch

from megatron_kd import topk_kl_loss
from reference import make_inputs


@pytest.fixture
def inp():
    return make_inputs(n_shape=(2, 5), V=20, H=8, K=4, seed=1)


def call(inp, **over):
    a = dict(hidden=inp["hidden"], weight=inp["weight"], topk_ids=inp["ids"], topk_logprobs=inp["logp"])
    kw = {k: v for k, v in over.items() if k not in a}
    a.update({k: v for k, v in over.items() if k in a})
    return topk_kl_loss(a["hidden"], a["weight"], a["topk_ids"], a["topk_logprobs"], **kw)


@pytest.mark.parametrize("over,match", [
    (dict(weight=torch.randn(8, 20, dtype=torch.float64)), "H must match"),
    (dict(weight=torch.randn(20, 8, 1, dtype=torch.float64)), "weight must be"),
    (dict(hidden=torch.randn(3, 5, 8, dtype=torch.float64)), "hidden's leading shape"),
    (dict(topk_logprobs=torch.zeros(2, 5, 3, dtype=torch.float64)), "topk_logprobs must have"),
    (dict(topk_ids=torch.zeros(2, 5, 4)), "topk_ids must be an integer"),
    (dict(topk_ids=torch.full((2, 5, 4), 20)), r"topk_ids must be in \[-1, 19\]"),
    (dict(topk_ids=torch.full((2, 5, 4), -2)), r"topk_ids must be in \[-1, 19\]"),
    (dict(topk_ids=torch.zeros(2, 5, 21, dtype=torch.long), topk_logprobs=torch.zeros(2, 5, 21)), "K=21"),
    (dict(tail="top"), "tail="),
    (dict(reduction="avg"), "reduction="),
    (dict(impl="fast"), "impl="),
    (dict(temperature=0.0), "temperature="),
    (dict(temperature=-1.0), "temperature="),
    (dict(labels=torch.zeros(2, 4, dtype=torch.long)), "labels must have shape"),
    (dict(labels=torch.full((2, 5), 20)), "labels must be in"),
    (dict(loss_mask=torch.ones(10)), "loss_mask must have shape"),
    (dict(loss_mask=-torch.ones(2, 5)), "non-negative"),
    (dict(ce_weight=1.0), "needs labels"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(valid_vocab_size=21), "valid_vocab_size"),
    (dict(weight=torch.randn(20, 8, dtype=torch.float32)), "dtype"),
])
def test_bad_input_raises_named_error(inp, over, match):
    with pytest.raises(ValueError, match=match):
        call(inp, **over)


def test_temperature_range_is_checked_with_the_options():
    """The range is the options' rule, so a recipe or Bridge `kd` section is refused when validated, before a
    step (it used to pass there and fail at the first loss call)."""
    from megatron_kd.loss.options import KDLoss, LossOptions
    for bad in (1e4, 1e-4, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"temperature=.* must be a finite number in \[0.001, 1000\]"):
            LossOptions(temperature=bad)
        with pytest.raises(ValueError, match=r"cache_temperature=.* must be a finite number"):
            KDLoss(cache_temperature=bad).loss_options()
    LossOptions(temperature=1e3, cache_temperature=1e-3)


def test_kd_loss_takes_the_options_as_objects(inp):
    """kd_loss (options and layout as objects, built once) and topk_kl_loss (its keyword form) are one loss; a
    metrics dict turns the monitor on whatever the options say; anything but the objects is refused by name."""
    from megatron_kd.loss import LossOptions, VocabLayout, kd_loss
    a = (inp["hidden"], inp["weight"], inp["ids"], inp["logp"])
    kw = dict(temperature=2.0, ce_weight=0.5, tail="bucket", impl="chunked", cache_temperature=1.5)
    opts = LossOptions(**kw)
    want = topk_kl_loss(*a, labels=inp["labels"], loss_mask=inp["loss_mask"], valid_vocab_size=20, **kw)
    got = kd_loss(*a, opts, VocabLayout(valid_vocab_size=20), labels=inp["labels"], loss_mask=inp["loss_mask"])
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"topk_ids must be in \[-1, 17\]"):  # the layout is read: 18 real ids
        kd_loss(*a, opts, VocabLayout(valid_vocab_size=18), labels=inp["labels"])
    metrics = {}
    kd_loss(*a, opts, labels=inp["labels"], metrics=metrics)
    assert metrics["kl_bucket"] >= 0
    with pytest.raises(ValueError, match="opts must be a megatron_kd.loss.LossOptions"):
        kd_loss(*a, kw, labels=inp["labels"])
    with pytest.raises(ValueError, match="layout must be a megatron_kd.parallel.VocabLayout"):
        kd_loss(*a, opts, (None, False), labels=inp["labels"])
