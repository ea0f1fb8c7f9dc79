"""One Triton program per row for the O(C x K) bookkeeping of the scaled path (loss/fused.py: TP = 1, tail "none",
CE only at T = 1): what loss/sparse.py (combine_stats + grad_coefficients) + the row scale compute in ~60 small
torch ops per chunk, in one launch. Each small launch idles the GPU between the chunk's GEMMs; the torch
functions stay the reference (tests/kernels/test_kernels_scaled.py compares the two).

Duplicate ids are found per row in the kernel (a K1 x K1 comparison), so the slots need no sort.
Per row, from the slot logits zg [K1] (z at the teacher ids, then the label; -inf where not owned), the
sweep's anchor a and sum se = sum exp(u - a) over the other columns, teacher log-probs and row weight g:
  lse = a + log(se + sum over first slots of exp(u - a))             (u = z / T)
  A   = T kw g P + cw g                                               (P = teacher mass on its ids)
  dz at slot j = A exp(u_j - lse) - T kw g sum_{i -> j} p_i - cw g [label -> j]   (i -> j: same column)
  scale = A exp(a - lse) (0 where bad), vals_j = dz_j / scale at first slots (0 elsewhere; 0 if scale is 0)
so that off the slots dz = scale * E with E = exp(u - a) as the sweep wrote it.
"""
import torch
import triton
import triton.language as tl

from .rows import INTERPRET, _acc, _consts


DIVERGENCE_CODES = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}  # the kernel's DIV
MAX_SLOTS = 256  # K1 above this: the K1 x K1 duplicate search outgrows a program (fused.py uses the torch ops)


def _kernel_dtype(dtype):
    """The interpreter (CPU tests) truncates fp32 -> bf16/fp16 where the GPU rounds to nearest even: there the
    kernels write fp32 and torch rounds, so CPU tests see the GPU's numerics."""
    return torch.float32 if INTERPRET and dtype in (torch.bfloat16, torch.float16) else dtype


@triton.jit
def _scaled_rows_kernel(zg_ptr, a_ptr, se_ptr, ast, bad_ptr, col_ptr, own_ptr, logp_ptr, valid_ptr,
                        g_ptr, lab_ptr, lse_ptr, uk_ptr, zy_ptr, scale_ptr, vals_ptr, rest_ptr, prm_ptr, K, K1,
                        HAS_BAD: tl.constexpr, NEED_KL: tl.constexpr, NEED_CE: tl.constexpr, KP: tl.constexpr,
                        ACC: tl.constexpr, DIV: tl.constexpr = 0, NEED_REST: tl.constexpr = False):
    r = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, KP)
    jin = js < K1
    tin = js < K
    inv_t = tl.load(prm_ptr)
    T = tl.load(prm_ptr + 1)
    kw = tl.load(prm_ptr + 2)
    cw = tl.load(prm_ptr + 3)
    beta = tl.load(prm_ptr + 4)
    zg = tl.load(zg_ptr + r * K1 + js, mask=jin, other=float("-inf")).to(ACC)
    own = tl.load(own_ptr + r * K1 + js, mask=jin, other=0) != 0
    col = tl.load(col_ptr + r * K1 + js, mask=jin, other=-1)
    # duplicate ids: slot j's column is represented by the first slot naming it (cid_j; K1 = not owned)
    same = (col[:, None] == col[None, :]) & own[:, None] & own[None, :]
    cid = tl.min(tl.where(same, js[:, None], K1), 0)
    first = own & (cid == js)
    a = tl.load(a_ptr + r * ast).to(ACC)
    se = tl.load(se_ptr + r * ast).to(ACC)
    u = zg * inv_t
    m = tl.where(tl.abs(a) < float("inf"), a, 0.0)  # an empty row's anchor is -inf
    e_slot = tl.where(first, tl.exp(u - m), 0.0)
    base = se * tl.exp(a - m)
    lse = m + tl.log(base + tl.sum(e_slot, 0))
    tl.store(lse_ptr + r, lse)
    if NEED_REST:  # log-sum-exp over every column but the teacher's ids (the label's column counts)
        tl.store(rest_ptr + r, m + tl.log(base + tl.sum(tl.where(js == K, e_slot, 0.0), 0)))
    tl.store(uk_ptr + r * K + js, tl.where(own & tin, u, 0.0), mask=tin)
    g = tl.load(g_ptr + r).to(ACC)
    dense = g * 0.0
    sp = tl.zeros([KP], ACC)  # sparse value of each slot, to be added at its column's first slot
    if NEED_KL:
        lp = tl.load(logp_ptr + r * K + js, mask=tin, other=0.0).to(ACC)
        vd = tl.load(valid_ptr + r * K + js, mask=tin, other=0) != 0
        ac = T * kw * g
        if DIV == 0:  # forward KL: dz = ac (P q - p)
            p = tl.where(vd, tl.exp(lp), 0.0)
            dense += ac * tl.sum(p, 0)
            sp -= ac * p
        else:  # reverse KL / JSD, tail none: H = q df/dq, dz = ac (H - q sum H) (loss/core.py _divergence_grad)
            lq = u - lse
            qk = tl.where(vd & own, tl.exp(lq), 0.0)
            if DIV == 1:
                G = lq - lp + 1.0
            else:
                x1 = lp + tl.log(beta)
                x2 = lq + tl.log(1.0 - beta)
                mx = tl.maximum(x1, x2)
                G = (1.0 - beta) * (lq - (mx + tl.log(tl.exp(x1 - mx) + tl.exp(x2 - mx))))
            H = tl.where(qk > 0.0, qk * G, 0.0)
            dense -= ac * tl.sum(H, 0)
            sp += ac * H
    if NEED_CE:
        lab = tl.load(lab_ptr + r)
        dense += cw * g
        sp = tl.where((js == K) & (lab >= 0), sp - cw * g, sp)
        tl.store(zy_ptr + r, tl.sum(tl.where((js == K) & own, zg, 0.0), 0))
    q = tl.where(own, tl.exp(u - lse), 0.0)
    add = tl.sum(tl.where(cid[:, None] == js[None, :], sp[:, None], 0.0), 0)  # slot i's value to column cid_i
    dz = q * dense + add
    scale = dense * tl.exp(a - lse)
    if HAS_BAD:
        scale = tl.where(tl.load(bad_ptr + r) != 0, 0.0, scale)
    tl.store(scale_ptr + r, scale)
    nz = scale != 0.0
    vals = tl.where(first, tl.where(nz, dz / tl.where(nz, scale, 1.0), 0.0), 0.0)
    tl.store(vals_ptr + r * K1 + js, vals.to(vals_ptr.dtype.element_ty), mask=jin)


def scaled_rows(zg, a, se, bad, col, own, logp, valid, labels, g, vals_dtype, *, temperature, kl_weight, ce_weight,
                jsd_beta, need_kl, need_ce, divergence, tail, monitor):
    """zg [C, K1] slot logits (math dtype), a / se [C] (equal row strides), bad [C] bool or None; col / own [C, K1]
    the slots' local columns and ownership (duplicates are found here, so the slots need no dedupe); logp / valid
    [C, K] the teacher's log-probs and non-empty slots, labels [C] (read only with need_ce), g [C] the row weights.
    Scalars: temperature, kl_weight, ce_weight, jsd_beta; need_kl / need_ce whether the KL and CE terms count;
    divergence and tail by name (only tail "none" is covered); monitor: also return rest_lse (log-sum-exp off the
    teacher's ids, for the bucket-KL monitor). Returns (lse, uk, zy or None, scale [C], vals [C, K1] vals_dtype,
    rest_lse or None)."""
    c, k1 = zg.shape
    if k1 > MAX_SLOTS or (need_ce and temperature != 1.0) or tail != "none" or divergence not in DIVERGENCE_CODES:
        raise ValueError(f"scaled_rows covers tail 'none', CE only at T = 1 and K1 <= {MAX_SLOTS} slots; got "
                         f"tail={tail!r}, ce_weight={ce_weight}, T={temperature}, K1={k1}")
    k = logp.shape[1]
    dt = zg.dtype
    lse = torch.empty(c, dtype=dt, device=zg.device)
    uk = torch.empty((c, k), dtype=dt, device=zg.device)
    zy = torch.empty(c, dtype=dt, device=zg.device) if need_ce else None
    scale = torch.empty(c, dtype=dt, device=zg.device)
    rest = torch.empty(c, dtype=dt, device=zg.device) if monitor else None
    vals = torch.empty((c, k1), dtype=_kernel_dtype(vals_dtype), device=zg.device)
    if c:
        assert a.stride(0) == se.stride(0) and zg.is_contiguous()
        prm = _consts(zg.device, dt, 1.0 / temperature, temperature, kl_weight, ce_weight, jsd_beta)
        lab = labels if need_ce else g
        _scaled_rows_kernel[(c,)](
            zg, a, se, a.stride(0), bad if bad is not None else g, col.contiguous(), own.contiguous(),
            logp.contiguous(), valid.contiguous(), g, lab, lse, uk,
            zy if zy is not None else lse, scale, vals, rest if rest is not None else lse, prm, k, k1,
            HAS_BAD=bad is not None, NEED_KL=need_kl, NEED_CE=need_ce,
            KP=max(2, triton.next_power_of_2(k1)), ACC=_acc(dt), DIV=DIVERGENCE_CODES[divergence],
            NEED_REST=rest is not None)
    return lse, uk, zy, scale, vals.to(vals_dtype), rest


@triton.jit
def _scale_rows_kernel(src_ptr, src_stride, scale_ptr, out_ptr, out_stride, H, BLOCK: tl.constexpr, ACC: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cs < H
    s = tl.load(scale_ptr + r).to(ACC)
    x = tl.load(src_ptr + r * src_stride + cs, mask=m, other=0.0).to(ACC)
    y = tl.where(s != 0.0, x * s, 0.0)  # where, not x * 0: a flagged row's values may be inf
    tl.store(out_ptr + r * out_stride + cs, y.to(out_ptr.dtype.element_ty), mask=m)


def scale_rows(src, scale, out):
    """out[r] = scale[r] * src[r] (0 where scale[r] == 0), computed in scale's dtype, one rounding to out's dtype:
    one pass instead of torch's multiply, mask and cast."""
    c, hdim = src.shape
    if c and hdim:
        assert src.stride(1) == 1 and out.stride(1) == 1 and scale.is_contiguous()
        dst = out if _kernel_dtype(out.dtype) == out.dtype else \
            torch.empty(out.shape, dtype=torch.float32, device=out.device)
        block = 1024
        _scale_rows_kernel[(c, triton.cdiv(hdim, block))](src, src.stride(0), scale, dst, dst.stride(0), hdim,
                                                          BLOCK=block, ACC=_acc(scale.dtype))
        if dst is not out:
            out.copy_(dst)
    return out
