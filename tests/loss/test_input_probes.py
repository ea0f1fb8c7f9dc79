"""Bad loss inputs: a ValueError naming the argument, found within one host sync (topk_kl_loss's input checks)."""
import math

import pytest
import torch

from megatron_kd import topk_kl_loss


def refused(probe, fn, name, exc=ValueError):
    """fn() raises exc whose one-line message names `name`."""
    with pytest.raises(exc) as e:
        fn()
    msg = str(e.value)
    assert name in msg and "\n" not in msg, f"{probe}: {name!r} not named in one line: {msg}"
    return msg


def _loss_inputs():
    g = torch.Generator().manual_seed(0)
    n, v, h, k = 6, 20, 8, 4
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    logp = torch.log_softmax(torch.randn(n, k, generator=g, dtype=torch.float64), -1)
    return dict(hidden=hidden, weight=weight, topk_ids=ids, topk_logprobs=logp,
                labels=torch.randint(0, v, (n,), generator=g), loss_mask=torch.ones(n, dtype=torch.float64))


def _with(**over):
    a = _loss_inputs()
    for key, fn in over.items():
        a[key] = fn(a[key]) if callable(fn) else fn
    return a


def _nan_at(x, v=math.nan):
    x = x.clone()
    x.view(-1)[3] = v
    return x


LOSS_PROBES = [
    ("loss_mask NaN", dict(loss_mask=_nan_at), {}, "loss_mask"),
    ("loss_mask inf", dict(loss_mask=lambda m: _nan_at(m, math.inf)), {}, "loss_mask"),
    ("loss_mask negative", dict(loss_mask=lambda m: _nan_at(m, -1.0)), {}, "loss_mask"),
    ("topk_logprobs +inf", dict(topk_logprobs=lambda x: _nan_at(x, math.inf)), {}, "topk_logprobs"),
    ("topk_logprobs positive", dict(topk_logprobs=lambda x: x + 4.0), {}, "topk_logprobs"),
    ("topk_logprobs NaN", dict(topk_logprobs=_nan_at), {}, "topk_logprobs"),
    ("temperature inf", {}, dict(temperature=math.inf), "temperature"),
    ("temperature 1e20", {}, dict(temperature=1e20), "temperature"),
    ("temperature NaN", {}, dict(temperature=math.nan), "temperature"),
    ("temperature 1e-9", {}, dict(temperature=1e-9), "temperature"),
    ("topk_ids on another device", dict(topk_ids=lambda x: x.to("meta")), {}, "topk_ids"),
    ("labels on another device", dict(labels=lambda x: x.to("meta")), {}, "labels"),
    ("loss_mask on another device", dict(loss_mask=lambda x: x.to("meta")), {}, "loss_mask"),
    ("weight on another device", dict(weight=lambda x: x.to("meta")), {}, "weight"),
]


@pytest.mark.parametrize("probe,over,kw,name", LOSS_PROBES, ids=[p[0] for p in LOSS_PROBES])
def test_bad_loss_input_names_the_argument(probe, over, kw, name):
    a = _with(**over)
    msg = refused(probe, lambda: topk_kl_loss(a["hidden"], a["weight"], a["topk_ids"], a["topk_logprobs"],
                                              labels=a["labels"], loss_mask=a["loss_mask"], ce_weight=0.5, **kw),
                  name, exc=ValueError)
    assert msg.startswith(name) or f"{name}=" in msg or f"{name} " in msg


def test_rounding_above_zero_is_accepted():
    # the top slot at p = 1 (+ rounding), the others pushed down so the position's mass stays ~1
    a = _with(topk_logprobs=lambda x: torch.where(x == x.max(-1, keepdim=True).values, 1e-6, x - 20))
    topk_kl_loss(a["hidden"], a["weight"], a["topk_ids"], a["topk_logprobs"])


def _count_syncs(monkeypatch):
    count = [0]
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *args, _orig=orig, **kw):
            count[0] += 1
            return _orig(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return count


@pytest.mark.parametrize("bad", [None, "loss_mask", "labels"])
def test_input_checks_make_at_most_one_host_sync(monkeypatch, bad):
    from megatron_kd.loss.inputs import check_and_flatten
    from megatron_kd.loss.options import LossOptions
    a = _loss_inputs()
    if bad == "loss_mask":
        a["loss_mask"] = _nan_at(a["loss_mask"])
    elif bad == "labels":
        a["labels"] = _nan_at(a["labels"], 99)
    opts = LossOptions(ce_weight=0.5)
    count = _count_syncs(monkeypatch)
    if bad is None:
        check_and_flatten(a["hidden"], a["weight"], a["topk_ids"], a["topk_logprobs"], a["labels"],
                          a["loss_mask"], opts, 20)
    else:
        with pytest.raises(ValueError, match=bad):
            check_and_flatten(a["hidden"], a["weight"], a["topk_ids"], a["topk_logprobs"], a["labels"],
                              a["loss_mask"], opts, 20)
    monkeypatch.undo()
    assert count[0] == 1, count[0]
