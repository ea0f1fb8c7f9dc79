"""Independent float64 reference: full logits, plain log_softmax, autograd. Shares no code with the package."""
import torch


def reference_loss(hidden, weight, ids, logp, labels=None, loss_mask=None, kl_weight=1.0, ce_weight=0.0,
                   temperature=1.0, tail="none", reduction="mean", ignore_index=-100, valid_vocab_size=None,
                   divergence="forward_kl", jsd_beta=0.5, cache_temperature=None, monitor=False):
    """monitor=True returns the bucket-tail KL(teacher || student) at T instead (unscaled, same reduction)."""
    h = hidden.reshape(-1, hidden.shape[-1]).double()
    w = weight.double()
    z = h @ w.t()
    if valid_vocab_size is not None and valid_vocab_size < w.shape[0]:
        z = torch.cat([z[:, :valid_vocab_size], torch.full_like(z[:, valid_vocab_size:], float("-inf"))], 1)
    k = ids.shape[-1]
    ids = ids.reshape(-1, k).long()
    ok = ids >= 0
    lp = logp.reshape(-1, k).double().masked_fill(~ok, 0.0)
    ok = ok & (lp > float("-inf"))
    lp = lp.masked_fill(~ok, 0.0)
    p = lp.exp() * ok
    if cache_temperature is not None and cache_temperature != temperature:
        a = cache_temperature / temperature
        R0 = 1 - p.sum(1)
        R0 = torch.where(R0 > 64 * torch.finfo(R0.dtype).eps, R0, 0.0)
        pa = torch.where(ok, p ** a, 0.0)
        Z = pa.sum(1) + torch.where(R0 > 0, R0 ** a, 0.0)
        p = pa / Z[:, None]
        lp = torch.where(ok, torch.log(p), 0.0)
    logq = torch.log_softmax(z / temperature, dim=-1)
    lqk = logq.gather(1, ids.clamp(min=0))
    if monitor:
        divergence, tail = "forward_kl", "bucket"
    qk = torch.where(ok, lqk.exp(), 0.0)
    # the classes compared: (teacher probs, student probs) per row
    if tail == "none":
        pc, qc = p, qk
    elif tail == "renormalize":
        P, S = p.sum(1, keepdim=True), qk.sum(1, keepdim=True)
        pc = torch.where(P > 0, p / P.clamp(min=1e-300), 0.0)  # clamps: no 0/0 in autograd's unused branch
        qc = torch.where(P > 0, qk / S.clamp(min=1e-300), 0.0)
    elif tail == "bucket":
        R = (1 - p.sum(1)).clamp(min=0)
        R = torch.where(R > 64 * torch.finfo(R.dtype).eps, R, 0.0)
        # the student's mass off the teacher's ids, summed directly (no 1 - S)
        hitm = torch.zeros_like(logq).scatter_add(1, ids.clamp(min=0), ok.double()) > 0
        r = torch.where(hitm, 0.0, logq.exp()).sum(1)
        pc, qc = torch.cat([p, R[:, None]], 1), torch.cat([qk, r[:, None]], 1)
    else:
        raise AssertionError(tail)
    def log(x):  # log with a finite gradient where x = 0 (those entries are never selected below)
        return torch.log(torch.where(x > 0, x, 1.0))
    if divergence == "forward_kl":
        kl = torch.where(pc > 0, pc * (log(pc) - log(qc)), 0.0).sum(1)
    elif divergence == "reverse_kl":
        pr = pc
        if tail == "bucket":  # the rest class's teacher mass is floored at 1e-6 inside the log
            pr = torch.cat([pc[:, :-1], pc[:, -1:].clamp(min=1e-6)], 1)
        kl = torch.where(qc > 0, qc * (log(qc) - log(pr)), 0.0).sum(1)
    elif divergence == "jsd":
        b = jsd_beta
        m = b * pc + (1 - b) * qc
        kl = (b * torch.where(pc > 0, pc * (log(pc) - log(m)), 0.0)
              + (1 - b) * torch.where(qc > 0, qc * (log(qc) - log(m)), 0.0)).sum(1)
    else:
        raise AssertionError(divergence)
    if monitor:
        kl_weight, temperature, ce_weight = 1.0, 1.0, 0.0
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
