"""The loss given a top-P cache's rows (a variable number of ids per position, -1 in the unused slots): every impl
and tail against the independent float64 reference, and the tails see the kept mass exactly."""
import itertools

import numpy as np
import pytest
import torch

from megatron_kd import topk_kl_loss
from megatron_kd.cache.encoding import get_encoding
from megatron_kd.cache.topp import select_top_p
from reference import reference_loss

IMPLS = ["dense", "chunked", "forward_chunked"]
TAILS = ["none", "renormalize", "bucket"]


def topp_rows(n=40, V=300, H=24, K=16, P=0.9, seed=0):
    """A student, and a teacher's top-K through the topp encoding (encode, then decode as the reader does)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64) * 0.7
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    sharp = torch.rand(n, 1, generator=g, dtype=torch.float64) * 5 + 0.5  # flat to peaked rows
    tlogp = torch.log_softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * sharp, -1)
    logp, ids = tlogp.topk(K, dim=-1)
    enc = get_encoding("topp", V, K, n, top_p=P)
    dec_ids, dec_lp = enc.decode(enc.encode(ids.numpy(), logp.float().numpy()))
    sel_ids, sel_lp, counts = select_top_p(ids.numpy(), logp.float().numpy(), P)
    return dict(hidden=hidden, weight=weight, ids=torch.from_numpy(dec_ids), logp=torch.from_numpy(dec_lp),
                sel=(sel_ids, sel_lp, counts))


@pytest.mark.parametrize("impl,tail", list(itertools.product(IMPLS, TAILS)))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_topp_rows_match_reference(impl, tail, dtype):
    inp = topp_rows(seed=IMPLS.index(impl) * 3 + TAILS.index(tail))
    counts = inp["sel"][2]
    assert counts.min() < counts.max() and counts.max() <= 16 and (inp["ids"] == -1).any()  # varied counts
    h = inp["hidden"].to(dtype).clone().requires_grad_(True)
    w = inp["weight"].to(dtype).clone().requires_grad_(True)
    out = topk_kl_loss(h, w, inp["ids"], inp["logp"], impl=impl, chunk_size=7, tail=tail, temperature=1.3)
    h64 = inp["hidden"].clone().requires_grad_(True)
    w64 = inp["weight"].clone().requires_grad_(True)
    ref = reference_loss(h64, w64, inp["ids"], inp["logp"].double(), tail=tail, temperature=1.3)
    out.backward()
    ref.backward()
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    for a, b in ((out.detach().double(), ref.detach()), (h.grad.double(), h64.grad), (w.grad.double(), w64.grad)):
        assert ((a - b).abs().max() / b.abs().max()).item() <= tol, (impl, tail)


def test_tails_see_the_kept_mass():
    """The bucket's rest class = 1 - the kept mass, as the selection computed it in fp64 (the encoding stores the
    log of the kept mass in fp32 and decodes to it): the cache gives the tails the true covered mass."""
    inp = topp_rows(n=64, seed=5)
    sel_ids, sel_lp, _ = inp["sel"]
    want = np.where(sel_ids >= 0, np.exp(sel_lp.astype(np.float64)), 0).sum(1)
    ok = inp["ids"] >= 0
    got = torch.where(ok, inp["logp"].double().exp(), 0.0).sum(1).numpy()
    np.testing.assert_allclose(got, want, rtol=3e-7)
    # and the bucket loss of a student equal to the teacher's kept entries is then ~0 (a true divergence)
    kl = {}
    topk_kl_loss(inp["hidden"], inp["weight"], inp["ids"], inp["logp"], tail="bucket", impl="dense", metrics=kl)
    assert kl["kl_bucket"] >= 0
