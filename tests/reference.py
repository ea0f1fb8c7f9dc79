"""Independent float64 reference: full logits, plain log_softmax, autograd. Shares no code with the package."""
import torch


def reference_loss(hidden, weight, ids, logp, labels=None, loss_mask=None, kl_weight=1.0, ce_weight=0.0,
                   temperature=1.0, tail="none", reduction="mean", ignore_index=-100, valid_vocab_size=None):
    h = hidden.reshape(-1, hidden.shape[-1]).double()
    w = weight.double()
    z = h @ w.t()
    if valid_vocab_size is not None and valid_vocab_size < w.shape[0]:
        z = torch.cat([z[:, :valid_vocab_size], torch.full_like(z[:, valid_vocab_size:], float("-inf"))], 1)
    k = ids.shape[-1]
    ids = ids.reshape(-1, k).long()
    ok = ids >= 0
    lp = logp.reshape(-1, k).double().masked_fill(~ok, 0.0)
    p = lp.exp() * ok
    logq = torch.log_softmax(z / temperature, dim=-1)
    lqk = logq.gather(1, ids.clamp(min=0))
    if tail == "none":
        kl = torch.where(ok, p * (lp - lqk), 0.0).sum(1)
    elif tail == "renormalize":
        P = p.sum(1, keepdim=True)
        pt = p / P
        lqt = torch.log_softmax(lqk.masked_fill(~ok, float("-inf")), dim=1)
        kl = torch.where(ok, pt * (torch.log(pt) - lqt), 0.0).sum(1)
        kl = torch.where(P[:, 0] > 0, kl, 0.0)
    elif tail == "bucket":
        kl = torch.where(ok, p * (lp - lqk), 0.0).sum(1)
        R = (1 - p.sum(1)).clamp(min=0)
        r = 1 - torch.where(ok, lqk.exp(), 0.0).sum(1)
        kl = kl + torch.where(R > 0, R * (torch.log(R) - torch.log(r)), 0.0)
    else:
        raise AssertionError(tail)
    loss = temperature ** 2 * kl_weight * kl
    n = h.shape[0]
    wgt = torch.ones(n, dtype=torch.float64, device=h.device) if loss_mask is None else loss_mask.reshape(-1).double()
    if labels is not None:
        lab = labels.reshape(-1).long()
        cnt = lab != ignore_index
        wgt = wgt * cnt
        if ce_weight:
            ce = -torch.log_softmax(z, -1).gather(1, lab.clamp(min=0)[:, None])[:, 0]
            loss = loss + ce_weight * torch.where(cnt, ce, 0.0)
    if reduction == "none":
        return torch.where(wgt > 0, loss, 0.0).reshape(ids_shape_lead(logp))
    if reduction == "sum":
        return (loss * wgt).sum()
    tot = wgt.sum()
    return (loss * wgt).sum() / tot if tot > 0 else (loss * 0).sum()


def ids_shape_lead(logp):
    return tuple(logp.shape[:-1])


def make_inputs(n_shape=(3, 7), H=16, V=50, K=6, dtype=torch.float64, seed=0, empty_frac=0.15,
                mask="random", labels=True, sharp=3.0, ignore_index=-100):
    """Random student and a teacher whose top-K come from a real full distribution (mass < 1)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*n_shape, H, generator=g, dtype=torch.float64) * 0.7
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    tlogits = torch.randn(*n_shape, V, generator=g, dtype=torch.float64) * sharp
    tlogp = torch.log_softmax(tlogits, -1)
    logp, ids = tlogp.topk(K, dim=-1)
    empty = torch.rand(ids.shape, generator=g) < empty_frac
    ids = ids.masked_fill(empty, -1)
    logp = logp.masked_fill(empty, float("nan"))  # empty slots' values must be ignored
    lm = None
    if mask == "random":
        lm = (torch.rand(n_shape, generator=g) < 0.8).double() * torch.rand(n_shape, generator=g).add(0.5)
    lab = None
    if labels:
        lab = torch.randint(0, V, n_shape, generator=g)
        lab = lab.masked_fill(torch.rand(n_shape, generator=g) < 0.1, ignore_index)
    return dict(hidden=hidden.to(dtype), weight=weight.to(dtype), ids=ids, logp=logp.to(torch.float32 if dtype != torch.float64 else dtype),
                labels=lab, loss_mask=lm)
