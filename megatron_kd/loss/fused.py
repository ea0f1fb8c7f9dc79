"""impl="fused": the sparse top-K KL with cuBLAS GEMMs and Triton sweeps over the logit rows (kernels/).

Forward does all the work (no recompute GEMM), token chunk by token chunk, on one of three loops that
chunks.chunk_plan picks (anchored, fp32_logits, two_pass; sizes from the caller's FusedSettings):
  1. the chunk's logits and their per-row sums (logits.py: AnchoredLogits or Fp32Logits, one interface);
  2. the per-row statistics and gradient coefficients: kernels.scaled (one launch per chunk, up to MAX_SLOTS
     slots) or sparse.py's torch ops (two-pass, and the fallback above MAX_SLOTS), + TP collectives;
  3. the logit gradient dz in the input dtype, then grad_h = dz @ W and grad_W += dz^T @ h (fp32 accumulator).

Two ways to get dz (both exact up to the input dtype's rounding of dz):
  scaled   (anchored and fp32_logits: TP = 1, tail "none", no CE at T != 1, non-negative weights)
           the sweep already writes E = exp(u - a) with a per-row anchor a, and dz = s_r * E off the slot
           columns with s_r = A_r exp(a_r - lse_r) known only after the sweep. s_r is a row scale, so it
           is applied to the GEMMs' small side: grad_h = s * (E @ W), grad_W += E^T @ (s * h).
           One read of the logits per element. With fp32 logits several sub-chunks fill one E super-chunk, so
           the weight-gradient GEMM sees many tokens per call (its fp32 read-modify-write is per call).
  two-pass (everything else) a second sweep writes dz = A exp(u - lse) + B exp(z - lse1) once the
           global statistics are known.
Slot columns (teacher ids, label) are masked in the sweep and get their finished values by one
scatter_add; s_r >= A_r e^-(slack + log V) keeps those values in range.
Anchored logits cost S x V bf16 (<= 0.9 x the bf16 weight); fp32 logits C x V fp32 plus S x V of E: about the
same time, the anchored path in less memory (benchmarks/README.md has the H200 figures).

Weight gradient: fp32 accumulator, or straight into weight.main_grad when the weight has an fp32 one
(Megatron's gradient-accumulation fusion: no extra memory); a bf16 main_grad (grad_reduce_in_fp32 off,
train.optimizer=lean_adam) gets the fp32 accumulator added once in forward (no bf16 weight-grad copy).
main_grad is written during forward assuming grad_output == grad_scale (the caller's promise, default 1.0;
Megatron's loss scale under fp16: training/step.py passes optim.setup.loss_scale); backward reads grad_output (one
host sync; 1.0 skips scaling grad_h, which is handed over, so backward runs once) and, if it differs from
grad_scale, adds the difference by recomputing the whole loss. Then, like Megatron's linear
layers, backward returns no weight gradient (or a dummy one and sets grad_added_to_main_grad, when the weight
carries that attribute).
reduction="none" needs per-position upstream grads, unknown in forward: it runs the torch "chunked" impl.
"""

from dataclasses import dataclass, replace

import torch

from ..kernels import gemm
from ..kernels.scaled import MAX_SLOTS, scale_rows, scaled_rows
from ..parallel.comm import all_reduce_sum, group_size
from .chunks import FusedSettings, chunk_plan, default_chunk_size
from .core import ChunkStats, chunk_loss, chunk_monitor
from .function import TopKKLFunction, reduce, row_weights
from .logits import AnchoredLogits, Fp32Logits
from .sparse import combine_stats, grad_coefficients, prepare_slots

SLACK = 20.0  # anchor slack (nats): E <= e^20, and rows are re-swept only beyond it
_TAKEN = object()  # backward has handed grad_h over


def _main_grad(weight):
    """weight.main_grad (Megatron DDP's buffer) when the loss can write the weight gradient into it."""
    mg = getattr(weight, "main_grad", None)
    if torch.is_tensor(mg) and mg.shape == weight.shape and mg.dtype in (torch.float32, torch.float64,
                                                                         torch.bfloat16, torch.float16):
        return mg
    return None


def _add_to_main(hidden, weight, t, opts, shard, main, wscale, settings) -> None:
    """main += wscale * dL/dW. An fp32 main_grad is the accumulator itself; a 16-bit one (bf16 grad buffer)
    gets an fp32 accumulator added once (one rounding, as DDP's own add; never bf16 across chunks)."""
    if main.dtype in (torch.float32, torch.float64):
        run(hidden, weight, t, opts, shard, settings, acc=main, wscale=wscale)
        return
    acc = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    run(hidden, weight, t, opts, shard, settings, acc=acc, wscale=wscale, acc_fresh=True)
    main.add_(acc)


def run(h, weight, t, opts, shard, settings: FusedSettings, *, grad_h=None, acc=None, wscale=1.0, acc_fresh=False,
        g=None, defer_redo=False):
    """One pass over all tokens. Fills grad_h [N, H] (if given, unreduced over TP) and acc [V, H] += wscale
    * dL/dW (if given) for grad_output = 1. Returns the per-position statistics (ChunkStats over N).
    acc_fresh: acc holds garbage (torch.empty); the first weight-gradient GEMM overwrites instead of adding
    (saves a memset of the fp32 accumulator), and rows never written are zeroed. g: the row weights
    (default: from t; given when run recomputes a subset of rows). defer_redo: return (statistics, redo) where
    redo() (None: nothing to redo) syncs, recomputes flagged rows and returns the final statistics; the GPU then
    never idles while the host queues the loss."""
    n = h.shape[0]
    v = shard.local_valid
    w = weight[:v]
    want = grad_h is not None or acc is not None
    # rows follow the global vocabulary, so a TP rank's buffers shrink with its shard
    plan = chunk_plan(shard.valid_size, h.shape[1], tp=group_size(shard.group), dtype=h.dtype, opts=opts,
                      settings=settings, needs_grad=want)
    scaled, anchored = plan.path != "two_pass", plan.path == "anchored"
    k1 = t.ids.shape[1] + int(opts.needs_ce)
    row_kernel = scaled and k1 <= MAX_SLOTS  # above: the torch bookkeeping (sparse.py)
    sl = prepare_slots(t, opts, shard, dedupe=not row_kernel)
    g = row_weights(t, opts) if g is None else g
    logits, bad_all = _make_logits(plan, h, w, sl, t.logp.dtype, want, opts, settings)
    p = _Pass(h, w, t, opts, shard, g, v, t.logp.dtype, want, grad_h, logits,
              _WeightGrad(acc, v, wscale, acc_fresh) if acc is not None else None)
    chunk = _row_kernel_chunk if row_kernel else _scaled_chunk if scaled else _two_pass_chunk
    stats = []
    for s0 in range(0, n, plan.super_rows):
        s1 = min(n, s0 + plan.super_rows)
        slc = sl.rows(s0, s1)
        e, zg, stat, bad = logits.sweep(s0, s1, slc)
        if bad is not None:
            bad_all[s0:s1] = bad
        stats.append(chunk(p, s0, s1, e, zg, stat, bad, slc))
    if p.wgrad is not None:
        p.wgrad.finish()
    out = ChunkStats.cat(stats)
    redo = None
    if anchored:  # one host sync per call, after every chunk is queued
        def redo():
            rows = bad_all.nonzero()[:, 0]
            if not rows.numel():
                return out
            return _redo_rows(rows, h, weight, t, opts, shard, grad_h, acc, wscale, g, out, settings)
    if defer_redo:  # the caller queues more GPU work (the loss) before it calls redo and syncs
        return out, redo
    return out if redo is None else redo()


def _make_logits(plan, h, w, sl, mdt, want, opts, settings):
    """The plan's logits (AnchoredLogits or Fp32Logits) and, for anchored ones, the flagged-rows mask [N]."""
    n = h.shape[0]
    T = opts.temperature
    scaled = plan.path != "two_pass"
    if plan.path == "anchored":
        return AnchoredLogits(h, w, sl, min(plan.super_rows, n), T), \
            torch.zeros(n, dtype=torch.bool, device=h.device)
    return Fp32Logits(h, w, sl, plan.sub_rows, min(plan.super_rows, n), mdt, want, scaled, T,
                      opts.ce_untempered, SLACK, settings.block), None


@dataclass
class _Pass:
    """What every chunk of one run reads: the inputs, the shard's weight rows w and gradient outputs."""
    h: torch.Tensor
    w: torch.Tensor
    t: object  # Targets
    opts: object  # LossOptions
    shard: object  # VocabShard
    g: torch.Tensor  # row weights [N]
    v: int  # the shard's valid vocabulary rows (0: nothing on this shard)
    mdt: torch.dtype  # math dtype
    want: bool  # some gradient is asked for
    grad_h: torch.Tensor | None
    logits: object  # AnchoredLogits or Fp32Logits
    wgrad: "_WeightGrad | None"


class _WeightGrad:
    """acc[:v] += wscale * E^T @ hs, chunk by chunk. fresh: acc came from torch.empty, so the first chunk
    overwrites (and zeroes the rows past v), and finish() zeroes acc if no chunk wrote it."""

    def __init__(self, acc, v, wscale, fresh):
        self.acc, self.v, self.wscale, self.fresh = acc, v, wscale, fresh

    def add(self, e, hs):
        acc, v = self.acc, self.v
        if self.fresh:  # first contribution: overwrite (acc came from torch.empty)
            gemm.mm_into(e.t(), hs, acc[:v])
            if self.wscale != 1.0:
                acc[:v].mul_(self.wscale)
            acc[v:].zero_()
            self.fresh = False
        else:
            gemm.addmm_(acc[:v], e.t(), hs, alpha=self.wscale)

    def finish(self):
        if self.fresh:  # nothing was written (no rows on this shard)
            self.acc.zero_()


def _kernel_rows(zg, stat, bad, slc, t, opts, g, vals_dtype):
    """kernels.scaled_rows on one chunk, the loss's slots, targets and options unpacked into its tensors and
    scalars."""
    return scaled_rows(zg, stat[:, 0], stat[:, 1], bad, slc.col, slc.own, t.logp, t.valid, t.labels, g, vals_dtype,
                       temperature=opts.temperature, kl_weight=opts.kl_weight, ce_weight=opts.ce_weight,
                       jsd_beta=opts.jsd_beta, need_kl=opts.needs_kl, need_ce=opts.needs_ce,
                       divergence=opts.divergence, tail=opts.tail, monitor=opts.monitor)


def _put_slot_values(p, s0, s1, e, slc, vals) -> bool:
    """Writes the slot columns' finished values into E. False when this shard holds no vocabulary rows: no
    gradient contribution, and the chunk's grad_h rows are zeroed."""
    if not p.v:
        if p.grad_h is not None:
            p.grad_h[s0:s1].zero_()
        return False
    e.scatter_add_(1, slc.col, vals.to(e.dtype))
    return True


def _row_kernel_chunk(p, s0, s1, e, zg, stat, bad, slc):
    """Scaled path, up to MAX_SLOTS slots: one kernel launch for the per-row statistics, coefficients and
    scale; the scale is applied to the GEMMs' small side."""
    lse, uk, zy, scale, vals, rest = _kernel_rows(zg, stat, bad, slc, p.t.slice(s0, s1), p.opts, p.g[s0:s1], e.dtype)
    st = ChunkStats(lse=lse, uk=uk, lse1=lse if p.opts.needs_ce else None, zy=zy, rest_lse=rest)
    if not p.want or not _put_slot_values(p, s0, s1, e, slc, vals):
        return st
    hs = p.h[s0:s1]
    if p.grad_h is not None:  # one pass; scale is 0 on flagged rows, whose E may hold huge values (no inf * 0)
        scale_rows(gemm.mm(e, p.w, p.mdt), scale, p.grad_h[s0:s1])
    if p.wgrad is not None:  # fp32 product, one rounding
        hs = scale_rows(hs if hs.stride(1) == 1 else hs.contiguous(), scale,
                        torch.empty(hs.shape, dtype=p.h.dtype, device=p.h.device))
        p.wgrad.add(e, hs)
    return st


def _scaled_chunk(p, s0, s1, e, zg, stat, bad, slc):
    """Scaled path above MAX_SLOTS slots: sparse.py's torch bookkeeping, then the row scale by torch ops."""
    st = combine_stats(zg, stat, slc, p.opts, p.shard)
    if not p.want:
        return st
    vals, A, B = grad_coefficients(zg, st, p.t.slice(s0, s1), slc, p.opts, p.g[s0:s1])
    scale = A * torch.exp(stat[:, 0] - st.lse)
    if bad is not None:  # flagged rows add nothing here; they are redone after the loop
        scale = torch.where(bad, torch.zeros_like(scale), scale)
    vals = torch.where((scale != 0)[:, None], vals / scale[:, None], torch.zeros_like(vals))
    if not _put_slot_values(p, s0, s1, e, slc, vals):
        return st
    hs = p.h[s0:s1]
    if p.grad_h is not None:
        gh = gemm.mm(e, p.w, p.mdt).mul_(scale[:, None])
        if bad is not None:  # where, not mul: a flagged row's E may hold huge values (inf * 0)
            gh = torch.where(bad[:, None], torch.zeros((), dtype=p.mdt, device=gh.device), gh)
        p.grad_h[s0:s1] = gh
    if p.wgrad is not None:
        p.wgrad.add(e, torch.mul(hs, scale[:, None]).to(p.h.dtype))  # fp32 product (type promotion), one rounding
    return st


def _two_pass_chunk(p, s0, s1, e, zg, stat, bad, slc):
    """Two-pass path: once the chunk's global statistics are known, a second sweep writes dz into E."""
    st = combine_stats(zg, stat, slc, p.opts, p.shard)
    if not p.want:
        return st
    vals, A, B = grad_coefficients(zg, st, p.t.slice(s0, s1), slc, p.opts, p.g[s0:s1])
    if p.v:
        lse1 = st.lse1 if B is not None else st.lse
        coef = torch.stack([A, st.lse, A if B is None else B, lse1], 1).contiguous()
        p.logits.dz(e, coef, B is not None)  # two-pass: S == C, one sub-chunk
    if not _put_slot_values(p, s0, s1, e, slc, vals):
        return st
    if p.grad_h is not None:
        gemm.mm_into(e, p.w, p.grad_h[s0:s1])
    if p.wgrad is not None:
        p.wgrad.add(e, p.h[s0:s1])
    return st


def _redo_rows(rows, h, weight, t, opts, shard, grad_h, acc, wscale, g, st, settings):
    """Anchored logits, flagged rows (their scale was 0, so they added nothing yet): recompute those rows alone
    with fp32 logits, adding to acc and writing their grad_h rows and statistics."""
    gh = None if grad_h is None else torch.empty((rows.numel(), h.shape[1]), dtype=grad_h.dtype, device=h.device)
    sub = run(h[rows], weight, t.take(rows), opts, shard, replace(settings, logits="fp32"), grad_h=gh, acc=acc,
              wscale=wscale, g=g[rows])
    if grad_h is not None:
        grad_h[rows] = gh
    return st.put(rows, sub)


class FusedTopKKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, t, opts, shard, reduce_grad_input, settings, grad_scale, metrics=None):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        mdt = t.logp.dtype
        main = _main_grad(weight) if need_w else None
        expect = float(grad_scale)
        grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None
        acc = None
        if need_w:
            acc = main if main is not None and main.dtype in (torch.float32, torch.float64) else \
                torch.empty(weight.shape, dtype=mdt if main is None else torch.float32, device=weight.device)
        st, redo = run(hidden, weight, t, opts, shard, settings, grad_h=grad_h, acc=acc,
                       wscale=expect if main is not None else 1.0, acc_fresh=acc is not main, defer_redo=True)
        out = reduce(chunk_loss(st, t, opts), t, opts)  # queued before redo's sync
        if redo is not None:
            st2 = redo()
            if st2 is not st:  # some rows were redone: their loss changed
                out = reduce(chunk_loss(st2, t, opts), t, opts)
            st = st2
        if opts.monitor and metrics is not None:  # the bucket-tail KL (docs/loss.md), from the same statistics
            metrics["kl_bucket"] = reduce(chunk_monitor(st, t), t, opts)
        if main is not None and acc is not main:  # 16-bit main_grad: one add of the fp32 result
            main.add_(acc)
        if grad_h is not None and reduce_grad_input:
            all_reduce_sum(grad_h, shard.group)
        ctx.main, ctx.expect, ctx.settings = main is not None, expect, settings
        ctx.opts, ctx.shard, ctx.t, ctx.weight_dtype = opts, shard, t, weight.dtype
        grad_w = None if (acc is None or main is not None) else acc.to(weight.dtype)
        del acc
        if ctx.main:  # handed over in backward (see there), not kept: no saved tensor aliases a caller's .grad
            ctx.grad_h = grad_h
            ctx.save_for_backward(hidden, weight)
        else:
            ctx.save_for_backward(grad_h, grad_w)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # a 0-dim grad_out keeps the result's dtype but multiplies in its own precision (not rounded to bf16)
        if not ctx.main:  # fresh tensors, no sync: a second backward (retain_graph) works
            grad_h, grad_w = ctx.saved_tensors
            gh = None if grad_h is None else grad_h * grad_out
            gw = None if grad_w is None else grad_w * grad_out
            return (gh, gw) + (None,) * (len(ctx.needs_input_grad) - 2)
        if ctx.grad_h is _TAKEN:
            raise RuntimeError("the fused loss wrote its weight gradient into main_grad in forward and hands its "
                               "input gradient over once: backward cannot run twice (retain_graph); call the loss "
                               "again instead")
        hidden, weight = ctx.saved_tensors
        grad_h, ctx.grad_h = ctx.grad_h, _TAKEN
        g0 = float(grad_out)  # host sync: main_grad already holds expect * dL/dW
        gh = None if grad_h is None else (grad_h if g0 == 1.0 else grad_h * grad_out)  # 1.0: no pass over [N, H]
        if g0 != ctx.expect:
            _add_to_main(hidden, weight, ctx.t, ctx.opts, ctx.shard, weight.main_grad, g0 - ctx.expect, ctx.settings)
        gw = None
        if hasattr(weight, "grad_added_to_main_grad"):  # Megatron's convention for fused wgrad accumulation
            make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
            gw = make(weight.shape, dtype=ctx.weight_dtype, device=weight.device)
            weight.grad_added_to_main_grad = True
        return (gh, gw) + (None,) * (len(ctx.needs_input_grad) - 2)


def fused_topk_kl(h, weight, t, opts, shard, reduce_grad_input=True, settings: FusedSettings | None = None,
                  grad_scale: float = 1.0, metrics=None):
    """h [N, H] (hidden dtype), weight [V_local, H]; returns the reduced loss (scalar) or [N] for "none".
    settings: FusedSettings (None: the production defaults). grad_scale: the grad_output backward will bring
    (with main_grad, anything else costs a second pass)."""
    settings = FusedSettings() if settings is None else settings
    if opts.reduction == "none" or h.shape[0] == 0:
        chunk = int(opts.chunk_size or default_chunk_size(shard.local_valid))
        return TopKKLFunction.apply(h, weight, t, opts, shard, "chunked", chunk, reduce_grad_input, metrics)
    return FusedTopKKL.apply(h, weight, t, opts, shard, reduce_grad_input, settings, grad_scale, metrics)
