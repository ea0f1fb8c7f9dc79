"""Triton kernels for the O(C x V) elementwise work over a chunk's logit rows (one program per row).

slot_gather_mask: reads the logits at the row's K+1 slot columns (teacher ids, label) and overwrites
    those columns with -inf, so every sum below covers the *other* columns: the bucket tail's rest mass
    comes without 1 - sum(q) cancellation and duplicate ids are added back exactly once (in torch).
row_sweep: sums exp(u - a) (and exp(z - aT) for CE at T != 1) relative to a per-row anchor a,
    optionally writing E = exp(u - a) in the output dtype in the same sweep. The anchor is
    max(u at the slots, u over the first tile); if the row's max beats it by more than `slack`, the row
    is swept again with a = max (rare; keeps E and the sums far from overflow).
row_grad: the second sweep of the two-pass path: dz = A exp(u - lse) + B exp(z - lse1), written in
    the output dtype (masked slot columns give 0; their values are added afterwards).
The sweeps only read z, so on the GPU they are autotuned over tile size and warps (key: V and flags).

Scalars (1/T, T, slack) reach the kernels through a small tensor in the accumulation dtype, never as
Python floats: a compiled kernel types a float argument as fp32 (the interpreter keeps float64), so
1/0.7 passed by value was off by ~3e-8 relative and the fp64 path missed its 1e-9 bar on the GPU.
(tl.exp / tl.log on fp64 already lower to libdevice's __nv_exp / __nv_log; ex2.approx is fp32 only.)
"""
import torch
import triton
import triton.language as tl
from triton import knobs

INTERPRET = bool(knobs.runtime.interpret)
_TILES = [(1024, 4), (2048, 4), (4096, 8), (8192, 8), (8192, 16)]
_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in _TILES]


@triton.jit
def _slot_kernel(z_ptr, z_stride, col_stride, idx_ptr, zg_ptr, K1, KP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    ks = tl.arange(0, KP)
    kin = ks < K1
    idx = tl.load(idx_ptr + row * K1 + ks, mask=kin, other=-1)
    own = idx >= 0
    at = z_row + idx.to(tl.int64) * col_stride
    zk = tl.load(at, mask=own, other=float("-inf"))
    tl.store(zg_ptr + row * K1 + ks, zk, mask=kin)
    tl.debug_barrier()  # every gather lands before any slot column is overwritten (duplicate ids)
    tl.store(at, tl.full([KP], float("-inf"), zk.dtype), mask=own)


@triton.jit
def _sweep(z_row, e_row, V, a, at, inv_t, BLOCK: tl.constexpr, WRITE_E: tl.constexpr,
           NEED_S1: tl.constexpr, ACC: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mx = tl.full([BLOCK], float("-inf"), ACC)
    s = tl.zeros([BLOCK], ACC)
    s1 = tl.zeros([BLOCK], ACC)
    for start in range(0, V, BLOCK):
        cols = start + offs
        m = cols < V
        x = tl.load(z_row + cols, mask=m, other=float("-inf")).to(ACC)
        u = x * inv_t
        mx = tl.maximum(mx, u)
        ex = tl.exp(u - a)
        s += ex
        if NEED_S1:
            s1 += tl.exp(x - at)
        if WRITE_E:
            tl.store(e_row + cols, ex.to(e_row.dtype.element_ty), mask=m)
    return tl.max(mx, 0), tl.sum(s, 0), tl.sum(s1, 0)


@triton.jit
def _sweep_kernel(z_ptr, z_stride, e_ptr, e_stride, zg_ptr, stat_ptr, V, K1, prm_ptr,
                  KP: tl.constexpr, WRITE_E: tl.constexpr, NEED_S1: tl.constexpr, ACC: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    inv_t = tl.load(prm_ptr).to(ACC)  # (1/T, T, slack) in ACC: no fp32 rounding of by-value floats
    t = tl.load(prm_ptr + 1).to(ACC)
    slack = tl.load(prm_ptr + 2).to(ACC)
    z_row = z_ptr + row * z_stride
    e_row = e_ptr + row * e_stride
    ks = tl.arange(0, KP)
    zk = tl.load(zg_ptr + row * K1 + ks, mask=ks < K1, other=float("-inf")).to(ACC)
    offs = tl.arange(0, BLOCK)
    x0 = tl.load(z_row + offs, mask=offs < V, other=float("-inf")).to(ACC)
    a = tl.maximum(tl.max(zk, 0), tl.max(x0, 0)) * inv_t
    a = tl.where(a == float("-inf"), 0.0, a)
    mx, s, s1 = _sweep(z_row, e_row, V, a, a * t, inv_t, BLOCK, WRITE_E, NEED_S1, ACC)
    if mx > a + slack:
        a = mx
        mx, s, s1 = _sweep(z_row, e_row, V, a, a * t, inv_t, BLOCK, WRITE_E, NEED_S1, ACC)
    tl.store(stat_ptr + row * 3, a)
    tl.store(stat_ptr + row * 3 + 1, s)
    tl.store(stat_ptr + row * 3 + 2, s1)


@triton.jit
def _grad_kernel(z_ptr, z_stride, d_ptr, d_stride, coef_ptr, V, prm_ptr, NEED_B: tl.constexpr,
                 ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    inv_t = tl.load(prm_ptr).to(ACC)
    A = tl.load(coef_ptr + row * 4).to(ACC)
    lse = tl.load(coef_ptr + row * 4 + 1).to(ACC)
    B = tl.load(coef_ptr + row * 4 + 2).to(ACC)
    lse1 = tl.load(coef_ptr + row * 4 + 3).to(ACC)
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + offs
        m = cols < V
        x = tl.load(z_ptr + row * z_stride + cols, mask=m, other=float("-inf")).to(ACC)
        d = A * tl.exp(x * inv_t - lse)
        if NEED_B:
            d += B * tl.exp(x - lse1)
        tl.store(d_ptr + row * d_stride + cols, d.to(d_ptr.dtype.element_ty), mask=m)


_sweep_tuned = triton.autotune(_CONFIGS, key=["V", "WRITE_E", "NEED_S1", "ACC"])(_sweep_kernel)
_grad_tuned = triton.autotune(_CONFIGS, key=["V", "NEED_B", "ACC"])(_grad_kernel)


def _acc(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


_PARAMS = {}


def _consts(device, acc_dtype, *values: float) -> torch.Tensor:
    """The given scalars on device in the accumulation dtype; cached (no host-to-device copy per launch)."""
    key = (str(device), acc_dtype) + tuple(float(v) for v in values)
    p = _PARAMS.get(key)
    if p is None:
        p = torch.tensor(values, dtype=torch.float64).to(acc_dtype).to(device)
        if len(_PARAMS) > 256:
            _PARAMS.clear()
        _PARAMS[key] = p
    return p


def _params(device, acc_dtype, temperature: float, slack: float = 0.0) -> torch.Tensor:
    """[1/T, T, slack] (see _consts)."""
    return _consts(device, acc_dtype, 1.0 / temperature, temperature, slack)


def _launch(raw, tuned, grid, block, *args, **kw):
    """Fixed tile when asked for (tests) or under the interpreter; autotuned otherwise."""
    if block or INTERPRET:
        b = block or 128
        raw[grid](*args, **kw, BLOCK=b, num_warps=8 if b >= 4096 else 4)
    else:
        tuned[grid](*args, **kw)


def slot_gather_mask(z, idx, out=None):
    """z [C, V] logits, any strides (slot columns are overwritten with -inf), idx [C, K1] int32 local slot
    columns (-1: not on this shard). Returns zg [C, K1] (or fills out, in out's dtype), the logits at the
    slots (-inf where not owned)."""
    c, k1 = idx.shape
    zg = torch.empty((c, k1), dtype=z.dtype, device=z.device) if out is None else out
    if c and k1:
        assert idx.is_contiguous() and zg.is_contiguous()
        _slot_kernel[(c,)](z, z.stride(0), z.stride(1), idx, zg, k1, KP=max(2, triton.next_power_of_2(k1)))
    return zg


def row_sweep(z, e, zg, temperature: float, need_s1: bool, slack: float, block: int | None = None, out=None):
    """After slot_gather_mask: stat [C, 3] = (a, sum exp(u - a), sum exp(z - a T)) over the non-slot
    columns (or fills out); with e [C, V] given, also writes e = exp(u - a) there (0 at the slots)."""
    c, v = z.shape
    stat = torch.empty((c, 3), dtype=z.dtype, device=z.device) if out is None else out
    if c == 0:
        return stat
    assert z.stride(1) == 1 and zg.is_contiguous() and stat.is_contiguous() and (e is None or e.stride(1) == 1)
    k1 = zg.shape[1]
    acc = torch.float64 if stat.dtype == torch.float64 else torch.float32  # z may be bf16 (bf16 logits)
    _launch(_sweep_kernel, _sweep_tuned, (c,), block,
            z, z.stride(0), z if e is None else e, 0 if e is None else e.stride(0), zg, stat, v, k1,
            _params(z.device, acc, temperature, slack), KP=max(2, triton.next_power_of_2(k1)),
            WRITE_E=e is not None, NEED_S1=need_s1, ACC=_acc(acc))
    return stat


def row_grad(z, d, coef, temperature: float, need_b: bool, block: int | None = None):
    """d[r] = A exp(z[r]/T - lse) + B exp(z[r] - lse1) with coef [C, 4] = (A, lse, B, lse1)."""
    c, v = z.shape
    if c:
        assert z.stride(1) == 1 and d.stride(1) == 1 and coef.is_contiguous()
        acc = torch.float64 if coef.dtype == torch.float64 else torch.float32
        _launch(_grad_kernel, _grad_tuned, (c,), block, z, z.stride(0), d, d.stride(0), coef, v,
                _params(z.device, acc, temperature), NEED_B=need_b, ACC=_acc(acc))
    return d

