"""impl="fused": the sparse top-K KL with cuBLAS GEMMs and one Triton sweep per logit row.

Forward does all the work (no recompute GEMM), token chunk by token chunk:
  1. z = h_c @ W^T into a reused fp32 buffer (bf16 operands, fp32 out);
  2. ops.rows: gather + mask the slot columns, then one sweep summing exp over the rest of each row;
  3. sparse.combine_stats (+ TP collectives: MAX [C], SUM [C, K+few]) and core.chunk_grad coefficients;
  4. the logit gradient dz in bf16, then grad_h = dz @ W and grad_W += dz^T @ h (fp32 accumulator).

Logits (settings LOGITS, default "anchored"): with bf16 inputs on the scaled path (below), kernels/anchored.py
writes anchored bf16 logits y^T = (z - b)^T [V, S] straight from the GEMM's epilogue and turns them into E in
place: one buffer of S x V bf16 (S <= 0.9 H rows, a multiple of 128: <= 0.9 x the bf16 weight), no fp32
logits; tokens whose logits stray too far above their anchor are redone with fp32 logits. Otherwise
(LOGITS="fp32", fp32 inputs, TP > 1, two-pass) the fp32 sub-chunk logits below.

Two ways to get dz (both exact up to bf16 rounding of dz):
  scaled   (tp == 1, tail "none", no CE at T != 1, non-negative weights: the training default)
           the sweep already writes E = exp(u - a) with a per-row anchor a, and dz = s_r * E off the slot
           columns with s_r = A_r exp(a_r - lse_r) known only after the sweep. s_r is a row scale, so it
           is applied to the GEMMs' small side: grad_h = s * (E @ W), grad_W += E^T @ (s * h).
           One read of the fp32 logits per element. Several z sub-chunks fill one E super-chunk, so the
           weight-gradient GEMM sees many tokens per call (its fp32 read-modify-write is per call).
  two-pass (everything else) a second sweep writes dz = A exp(u - lse) + B exp(z - lse1) once the
           global statistics are known.
Slot columns (teacher ids, label) are masked in the sweep and get their finished values by one
scatter_add; s_r >= A_r e^-(slack + log V) keeps those values in range.
Settings (DEFAULTS below; each overridable by an environment variable, ranked by benchmarks/kernel_tune.py):
  Z_MIB    MEGATRON_KD_FUSED_Z_MIB     fp32 logits buffer of one sub-chunk (rows C = Z / 4V)
  E_MIB    MEGATRON_KD_FUSED_E_MIB     bf16 dz buffer of one super-chunk (rows S = E / 2V). Each super-chunk
           costs one fp32 read-modify-write of the weight-gradient accumulator (|W| x 8 bytes) and ~60 small
           torch ops, so fewer, larger super-chunks are faster; the buffer is the price. 1024 (S=4096 at
           V=128256) measured 129.6 ms against 136 ms for 512 on an H200 (N=32768).
  OVERLAP  MEGATRON_KD_FUSED_OVERLAP   1: sweeps on a side stream under the next sub-chunk's GEMM (two fp32
           logit buffers; or tuning overlap=True).
  A_MIB    MEGATRON_KD_FUSED_A_MIB     anchored buffer (0: 0.9 x the bf16 weight); fewer, larger chunks are faster
  LOGITS   MEGATRON_KD_FUSED_LOGITS    "anchored" (default, above), "fp32", or "bf16": plain bf16 logits (no
           anchor; half the sweep's reads). Rounding z itself to bf16 costs |z| 2^-9 per logit: ~1.2e-2
           gradient error at |z| ~ 30 (simulated), which the anchor avoids.
  ROWS     MEGATRON_KD_FUSED_ROWS      "kernel" (default): the scaled path's per-row statistics, coefficients and
           scale in one Triton launch per chunk (ops/scaled.py); "torch": sparse.py's ~60 small ops instead.
  H200, N=32768, V=128256, weight grad into main_grad (benchmarks/results/loss_fused_v128k_h200.json, code 9ac97e4):
  anchored 122.6 ms, 3.40 GiB peak; "fp32" 121.2 ms, 5.31 GiB; the three GEMMs alone 109.0 ms.

Weight gradient: fp32 accumulator, or straight into weight.main_grad when the weight has an fp32 one
(Megatron's gradient-accumulation fusion: no extra memory); a bf16 main_grad (grad_reduce_in_fp32 off,
train.optimizer=lean_adam) gets the fp32 accumulator added once in forward (no bf16 weight-grad copy).
main_grad is written during forward assuming grad_output == weight.megatron_kd_grad_scale (default 1.0);
backward reads grad_output (one host sync; 1.0 skips scaling grad_h, which is handed over, so backward runs
once) and, if it differs from that scale, adds the difference by recomputing. Then, like Megatron's linear
layers, backward returns no weight gradient (or a dummy one and sets grad_added_to_main_grad, when the weight
carries that attribute).
reduction="none" needs per-position upstream grads, unknown in forward: it runs the torch "chunked" impl.
"""

import torch

from ..kernels import gemm
from ..kernels.rows import row_grad, row_sweep, slot_gather_mask
from ..kernels.scaled import MAX_SLOTS, scale_rows, scaled_rows
from ..parallel.comm import all_reduce_sum, group_size
from .core import ChunkStats, chunk_loss, chunk_monitor
from .function import TopKKLFunction, reduce, row_weights
from .sparse import combine_stats, grad_coefficients, prepare_slots

from .anchored import AnchoredLogits, anchor_columns, anchor_ids
from .settings import A_BYTES, DEFAULTS, E_BYTES, LOGITS, MIB, OVERLAP, ROWS, Z_BYTES, anchored_rows  # noqa: F401
SLACK = 20.0  # anchor slack (nats): E <= e^20, and rows are re-swept only beyond it
GRAD_SCALE_ATTR = "megatron_kd_grad_scale"
_TAKEN = object()  # backward has handed grad_h over


def _round(x: int, q: int) -> int:
    return max(q, x // q * q)


def plan_chunks(n, vocab, opts, scaled, sub=None, sup=None):
    """(sub-chunk rows C for the fp32 logits, super-chunk rows S for dz; C divides S). Two-pass: C == S.
    Budgets (Z_BYTES / E_BYTES, read at call time so benchmarks can sweep them) hold at TP=1."""
    v = max(1, vocab)
    z_bytes, e_bytes = Z_BYTES, E_BYTES
    if sup is None and opts.chunk_size:
        sup = int(opts.chunk_size)
    if not scaled:
        c = sup or sub or _round((z_bytes + e_bytes) // (6 * v), 16)
        return c, c
    c = sub or _round(z_bytes // (4 * v), 16)
    s = sup or _round(e_bytes // (2 * v), c)
    c = min(c, s)
    return c, max(c, s // c * c)


def _use_scaled(opts, shard, dtype) -> bool:
    # fp16 is out: E = exp(u - a) may reach e^slack, beyond its range
    return (group_size(shard.group) == 1 and opts.tail == "none" and opts.kl_weight >= 0
            and opts.ce_weight >= 0 and not (opts.needs_ce and opts.temperature != 1.0)
            and dtype in (torch.bfloat16, torch.float32, torch.float64))


def _main_grad(weight):
    """weight.main_grad (Megatron DDP's buffer) when the loss can write the weight gradient into it."""
    mg = getattr(weight, "main_grad", None)
    if torch.is_tensor(mg) and mg.shape == weight.shape and mg.dtype in (torch.float32, torch.float64,
                                                                         torch.bfloat16, torch.float16):
        return mg
    return None


def _add_to_main(hidden, weight, t, opts, shard, main, wscale, tuning) -> None:
    """main += wscale * dL/dW. An fp32 main_grad is the accumulator itself; a 16-bit one (bf16 grad buffer)
    gets an fp32 accumulator added once (one rounding, as DDP's own add; never bf16 across chunks)."""
    if main.dtype in (torch.float32, torch.float64):
        run(hidden, weight, t, opts, shard, acc=main, wscale=wscale, **tuning)
        return
    acc = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    run(hidden, weight, t, opts, shard, acc=acc, wscale=wscale, acc_fresh=True, **tuning)
    main.add_(acc)


class _Logits:
    """Per super-chunk: the logits GEMM of each sub-chunk into a reused fp32 buffer, then the slot and sweep
    kernels. With overlap (CUDA), the sweeps run on a side stream over two alternating buffers, so the
    memory-bound sweep of sub-chunk i runs under the compute-bound GEMM of sub-chunk i+1."""

    def __init__(self, h, w, sl, C, mdt, overlap, zdt=None):
        self.h, self.w, self.sl, self.C, self.mdt = h, w, sl, C, mdt
        self.overlap = overlap and h.is_cuda
        rows_ = min(C, h.shape[0])
        self.zbufs = [torch.empty((rows_, w.shape[0]), dtype=zdt or mdt, device=h.device)
                      for _ in range(2 if self.overlap else 1)]
        self.free = [None] * len(self.zbufs)  # side-stream events: buffer i may be overwritten
        self.side = _side_stream(h.device) if self.overlap else None
        self.z = None

    def sweep(self, s0, s1, e, sweep_kw):
        """zg [s1-s0, K1] and stat [s1-s0, 3] for rows [s0, s1); e (rows s0..s1 of E) or None."""
        mdt = self.mdt  # statistics stay in the math dtype when the logits are bf16
        zg = torch.empty((s1 - s0, self.sl.k1), dtype=mdt, device=self.h.device)
        stat = torch.empty((s1 - s0, 3), dtype=mdt, device=self.h.device)
        if self.w.shape[0] == 0:  # this rank's shard is all padding
            zg.fill_(float("-inf"))
            stat.copy_(torch.tensor([float("-inf"), 0.0, 0.0], dtype=mdt).expand(s1 - s0, 3))
            return zg, stat
        main = torch.cuda.current_stream(self.h.device) if self.overlap else None
        for i, c0 in enumerate(range(s0, s1, self.C)):
            c1 = min(s1, c0 + self.C)
            k = i % len(self.zbufs)
            z = self.z = self.zbufs[k][: c1 - c0]
            if self.overlap and self.free[k] is not None:
                main.wait_event(self.free[k])
            gemm.mm_into(self.h[c0:c1], self.w.t(), z)
            args = (z, None if e is None else e[c0 - s0: c1 - s0], zg[c0 - s0: c1 - s0], stat[c0 - s0: c1 - s0])
            if not self.overlap:
                self._kernels(c0, c1, *args, **sweep_kw)
                continue
            ready = torch.cuda.Event()
            ready.record(main)
            with torch.cuda.stream(self.side):
                self.side.wait_event(ready)
                self._kernels(c0, c1, *args, **sweep_kw)
                self.free[k] = torch.cuda.Event()
                self.free[k].record(self.side)
        if self.overlap:
            main.wait_stream(self.side)
        return zg, stat

    def _kernels(self, c0, c1, z, e, zg, stat, **kw):
        slot_gather_mask(z, self.sl.idx[c0:c1], out=zg)
        row_sweep(z, e, zg, out=stat, **kw)


_SIDE = {}


def _side_stream(device):
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device=device)
    return _SIDE[device]


def _logits_mode(logits):
    logits = LOGITS if logits is None else logits
    if logits not in ("anchored", "fp32", "bf16"):
        raise ValueError(f"fused logits must be 'anchored', 'fp32' or 'bf16', got {logits!r}")
    return logits


def _logits_dtype(logits, h_dtype, mdt):
    if logits == "bf16" and h_dtype in (torch.bfloat16, torch.float16) and mdt == torch.float32:
        return h_dtype
    return mdt


def run(h, weight, t, opts, shard, *, grad_h=None, acc=None, wscale=1.0, sub=None, sup=None, block=None,
        force_two_pass=False, overlap=None, logits=None, acc_fresh=False, g=None, row_math=None,
        defer_redo=False):
    """One pass over all tokens. Fills grad_h [N, H] (if given, unreduced over TP) and acc [V, H] += wscale
    * dL/dW (if given) for grad_output = 1. Returns the per-position statistics (ChunkStats over N).
    acc_fresh: acc holds garbage (torch.empty); the first weight-gradient GEMM overwrites instead of adding
    (saves a memset of the fp32 accumulator), and rows never written are zeroed. g: the row weights
    (default: from t; given when run recomputes a subset of rows). row_math: "kernel" (ops.scaled, one launch per
    chunk) or "torch" (sparse.py, the reference) for the scaled path's per-row bookkeeping. defer_redo: return
    (statistics, redo) where redo() (None: nothing to redo) syncs, recomputes flagged rows and returns the
    final statistics; the GPU then never idles while the host queues the loss."""
    n = h.shape[0]
    v = shard.local_valid
    w = weight[:v]
    mdt = t.logp.dtype
    T = float(opts.temperature)
    want = grad_h is not None or acc is not None
    scaled = want and _use_scaled(opts, shard, h.dtype) and not force_two_pass
    mode = _logits_mode(logits)
    k1 = t.ids.shape[1] + int(opts.needs_ce)
    row_kernel = scaled and (ROWS if row_math is None else row_math) == "kernel" and k1 <= MAX_SLOTS
    anchored = scaled and mode == "anchored" and h.dtype == torch.bfloat16 and v > 0 and mdt == torch.float32
    # rows follow the global vocabulary, so a TP rank's buffers shrink with its shard
    if anchored:
        C = S = max(1, sup or int(opts.chunk_size or 0) or anchored_rows(shard.valid_size, h.shape[1], A_BYTES))
    else:
        C, S = plan_chunks(n, shard.valid_size, opts, scaled, sub=sub, sup=sup)
    sl = prepare_slots(t, opts, shard, dedupe=not row_kernel)
    g = row_weights(t, opts) if g is None else g
    if anchored:
        logits = AnchoredLogits(min(S, n), v, h)
        aidx = anchor_ids(sl.idx, anchor_columns(sl.k, sl.k1))
        bad_all = torch.zeros(n, dtype=torch.bool, device=h.device)
    else:
        logits = _Logits(h, w, sl, C, mdt, (OVERLAP if overlap is None else overlap) and S > C,
                         zdt=_logits_dtype(mode, h.dtype, mdt))
    fresh = acc is not None and acc_fresh
    ebuf = torch.empty((min(S, n), v), dtype=h.dtype, device=h.device) if want and not anchored else None
    sweep_kw = dict(temperature=T, need_s1=opts.needs_ce and T != 1.0, slack=SLACK, block=block)
    stats = []
    for s0 in range(0, n, S):
        s1_ = min(n, s0 + S)
        slc = sl.rows(s0, s1_)
        if anchored:
            e, zg, stat, bad = logits.sweep(h[s0:s1_], w, slc.idx, aidx[s0:s1_], T)
            bad_all[s0:s1_] = bad
        else:
            zg, stat = logits.sweep(s0, s1_, ebuf[: s1_ - s0] if scaled else None, sweep_kw)
            e = None if ebuf is None else ebuf[: s1_ - s0]
        if row_kernel:  # one launch for the per-row statistics, coefficients and scale
            lse, uk, zy, scale, vals, rest = scaled_rows(zg, stat[:, 0], stat[:, 1], bad if anchored else None, slc,
                                                   t.slice(s0, s1_), opts, g[s0:s1_], e.dtype)
            stats.append(ChunkStats(lse=lse, uk=uk, lse1=lse if opts.needs_ce else None, zy=zy, rest_lse=rest))
        else:
            st = combine_stats(zg, stat, slc, opts, shard)
            stats.append(st)
            if want:
                vals, A, B = grad_coefficients(zg, st, t.slice(s0, s1_), slc, opts, g[s0:s1_])
        if not want:
            continue
        if scaled and not row_kernel:
            scale = A * torch.exp(stat[:, 0] - st.lse)
            if anchored:  # flagged rows add nothing here; they are redone after the loop
                scale = torch.where(bad, torch.zeros_like(scale), scale)
            vals = torch.where((scale != 0)[:, None], vals / scale[:, None], torch.zeros_like(vals))
        elif not scaled and v:
            lse1 = st.lse1 if B is not None else st.lse
            coef = torch.stack([A, st.lse, A if B is None else B, lse1], 1).contiguous()
            row_grad(logits.z, e, coef, T, B is not None, block)  # two-pass: S == C, one sub-chunk
        if not v:  # nothing on this shard: no gradient contribution
            if grad_h is not None:
                grad_h[s0:s1_].zero_()
            continue
        e.scatter_add_(1, slc.col, vals.to(e.dtype))
        hs = h[s0:s1_]
        if grad_h is not None:
            if row_kernel:  # one pass; scale is 0 on flagged rows, whose E may hold huge values (no inf * 0)
                scale_rows(gemm.mm(e, w, mdt), scale, grad_h[s0:s1_])
            elif scaled and anchored:  # where, not mul: a flagged row's E may hold huge values (inf * 0)
                gh = gemm.mm(e, w, mdt)
                grad_h[s0:s1_] = torch.where(bad[:, None], torch.zeros((), dtype=mdt, device=gh.device),
                                             gh.mul_(scale[:, None]))
            elif scaled:
                grad_h[s0:s1_] = gemm.mm(e, w, mdt).mul_(scale[:, None])
            else:
                gemm.mm_into(e, w, grad_h[s0:s1_])
        if acc is not None:
            if row_kernel:  # fp32 product, one rounding
                hs = scale_rows(hs if hs.stride(1) == 1 else hs.contiguous(), scale,
                                torch.empty(hs.shape, dtype=h.dtype, device=h.device))
            elif scaled:
                hs = torch.mul(hs, scale[:, None]).to(h.dtype)  # fp32 product (type promotion), one rounding
            if fresh:  # first contribution: overwrite (acc came from torch.empty)
                gemm.mm_into(e.t(), hs, acc[:v])
                if wscale != 1.0:
                    acc[:v].mul_(wscale)
                acc[v:].zero_()
                fresh = False
            else:
                gemm.addmm_(acc[:v], e.t(), hs, alpha=wscale)
    if fresh:  # nothing was written (no rows on this shard)
        acc.zero_()
    out = ChunkStats.cat(stats)
    redo = None
    if anchored:  # one host sync per call, after every chunk is queued
        def redo():
            rows = bad_all.nonzero()[:, 0]
            if not rows.numel():
                return out
            return _redo_rows(rows, h, weight, t, opts, shard, grad_h, acc, wscale, g, out,
                              dict(sub=sub, sup=sup, block=block, row_math=row_math))
    if defer_redo:  # the caller queues more GPU work (the loss) before it calls redo and syncs
        return out, redo
    return out if redo is None else redo()


def _redo_rows(rows, h, weight, t, opts, shard, grad_h, acc, wscale, g, st, tuning):
    """Anchored logits, flagged rows (their scale was 0, so they added nothing yet): recompute those rows alone
    with fp32 logits, adding to acc and writing their grad_h rows and statistics."""
    gh = None if grad_h is None else torch.empty((rows.numel(), h.shape[1]), dtype=grad_h.dtype, device=h.device)
    sub = run(h[rows], weight, t.take(rows), opts, shard, grad_h=gh, acc=acc, wscale=wscale, logits="fp32",
              g=g[rows], **tuning)
    if grad_h is not None:
        grad_h[rows] = gh
    return st.put(rows, sub)


class FusedTopKKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, t, opts, shard, reduce_grad_input, tuning, metrics=None):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        mdt = t.logp.dtype
        main = _main_grad(weight) if need_w else None
        expect = float(getattr(weight, GRAD_SCALE_ATTR, 1.0))
        grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None
        acc = None
        if need_w:
            acc = main if main is not None and main.dtype in (torch.float32, torch.float64) else \
                torch.empty(weight.shape, dtype=mdt if main is None else torch.float32, device=weight.device)
        st, redo = run(hidden, weight, t, opts, shard, grad_h=grad_h, acc=acc,
                       wscale=expect if main is not None else 1.0, acc_fresh=acc is not main, defer_redo=True,
                       **tuning)
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
        ctx.main, ctx.expect, ctx.tuning = main is not None, expect, tuning
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
            _add_to_main(hidden, weight, ctx.t, ctx.opts, ctx.shard, weight.main_grad, g0 - ctx.expect, ctx.tuning)
        gw = None
        if hasattr(weight, "grad_added_to_main_grad"):  # Megatron's convention for fused wgrad accumulation
            make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
            gw = make(weight.shape, dtype=ctx.weight_dtype, device=weight.device)
            weight.grad_added_to_main_grad = True
        return (gh, gw) + (None,) * (len(ctx.needs_input_grad) - 2)


def fused_topk_kl(h, weight, t, opts, shard, reduce_grad_input=True, metrics=None, **tuning):
    """h [N, H] (hidden dtype), weight [V_local, H]; returns the reduced loss (scalar) or [N] for "none".
    tuning (tests/benchmarks): sub / sup (chunk rows), block (Triton tile), force_two_pass, overlap,
    logits ("fp32" / "bf16"), row_math ("torch"); None or absent: the module settings (DEFAULTS / environment)."""
    if opts.reduction == "none" or h.shape[0] == 0:
        from .api import default_chunk_size
        chunk = int(opts.chunk_size or default_chunk_size(shard.local_valid))
        return TopKKLFunction.apply(h, weight, t, opts, shard, "chunked", chunk, reduce_grad_input, metrics)
    return FusedTopKKL.apply(h, weight, t, opts, shard, reduce_grad_input, tuning, metrics)
