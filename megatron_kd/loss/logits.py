"""The two ways impl="fused" makes a super-chunk's logits, behind one interface: `sweep(s0, s1, slots)` returns
(e, zg, stat, bad) for tokens [s0, s1):
  e     [S', V] view of the chunk's E = exp(u - a) (one-sweep paths), of the dz buffer still to be written (two-pass),
        or None (no gradient wanted);
  zg    [S', K1] logits at the slot columns (teacher ids, label; -inf where not on this shard), math dtype;
  stat  [S', 3] = (a, sum of E over the other columns, sum exp(z - a T) for CE at T != 1);
  bad   [S'] bool, tokens to redo with fp32 logits (anchored), or None.

Fp32Logits (fp32_logits and two_pass paths): per sub-chunk of C tokens, z = h @ W^T into a reused buffer in the
math dtype, then ops.rows' slot and sweep kernels; the two-pass path's second sweep (dz) is `dz`.

AnchoredLogits (anchored path: bf16 inputs, TP = 1), per super-chunk of S tokens:
  1. an anchor per token, b = max of the student's logits at a few slot ids (teacher's top ids, the label),
     rounded to bf16 (any anchor is exact: the same b is subtracted and added back);
  2. one GEMM writes y^T = (z - b)^T [V, S] in bf16 (cuBLASLt bias epilogue: fp32 sum, one rounding);
  3. the slot kernel reads y at the slots and masks them; kernels.cols.col_sweep turns y into E = exp(y / T) in
     place and returns sum(E) and max(y) per token. E = exp(u - a) with a = b / T: the scaled path's dz = s E.
bf16 keeps y to 2^-9 |y| relative, so where the softmax mass is (y near max y) the error stays below
TAU 2^-9 (0.8%) as long as max y <= TAU. A token whose max y (slots included) exceeds min(TAU, 60 T) (its
student ranks something far above its logits at the anchor ids; 60 T keeps y / T below the sweep's clamp), or
whose sum is not finite, is flagged on the device: its row scale is set to 0, so it adds nothing to either
gradient, and after the last chunk (one host sync per call) the flagged tokens are recomputed alone with fp32
logits (fused.run on those rows). No per-chunk sync.
Memory: S x V bf16 (chunks.anchored_rows: by default <= 0.9 x the bf16 weight, S <= 0.9 H) instead of fp32
sub-chunk logits plus the bf16 dz buffer.
"""
import torch

from ..kernels import gemm
from ..kernels.cols import anchor_logits, col_sweep
from ..kernels.rows import row_grad, row_sweep, slot_gather_mask

TAU = 4.0
ANCHOR_SLOTS = 4


def anchor_columns(k: int, k1: int) -> list[int]:
    """Slot columns used for the anchor: the first teacher ids (the cache stores them best first) and the label."""
    cols = list(range(min(k, ANCHOR_SLOTS - (k1 > k))))
    return cols + ([k] if k1 > k else [])


def anchor_ids(idx: torch.Tensor, cols: list[int]) -> torch.Tensor:
    """[N, J] int32 local ids at the anchor slots, for all rows at once. Column slices, not idx[:, cols]: a list
    index is copied host-to-device, which synchronizes with the GPU (once per chunk, idling it)."""
    return torch.cat([idx[:, c:c + 1] for c in cols], 1) if cols else idx[:, :0].contiguous()


class AnchoredLogits:
    def __init__(self, h, w, sl, rows: int, temperature: float):
        self.h, self.w, self.T, self.v = h, w, float(temperature), w.shape[0]
        self.buf = torch.empty(rows * self.v, dtype=h.dtype, device=h.device)
        self.aidx = anchor_ids(sl.idx, anchor_columns(sl.k, sl.k1))

    def sweep(self, s0, s1, slc):
        c = s1 - s0
        hs = self.h[s0:s1]
        hs = hs if hs.stride(1) == 1 else hs.contiguous()  # the anchor kernel reads rows
        b = anchor_logits(hs, self.w, self.aidx[s0:s1])
        yt = self.buf[: self.v * c].view(self.v, c)
        gemm.mm_bias_t_into(self.w, hs, -b, yt)
        zg = torch.empty(slc.idx.shape, dtype=torch.float32, device=hs.device)
        slot_gather_mask(yt.t(), slc.idx, out=zg)
        s, ymax = col_sweep(yt, self.T)
        bf = b.float()
        lim = min(TAU, 60.0 * self.T)  # and y / T <= 60: the sweep's clamp at 80 never touches a kept row
        bad = (ymax > lim) | (zg.amax(1) > lim) | ~torch.isfinite(s)
        zg += bf[:, None]
        stat = torch.stack([bf / self.T, s, torch.zeros_like(s)], 1)
        return yt.t(), zg, stat, bad


class Fp32Logits:
    """write_e: the sweep writes E into the chunk buffer (fp32_logits); False: the buffer waits for dz (two-pass).
    want: gradients wanted (a [S, V] buffer in the input dtype); rows: super-chunk tokens; C: sub-chunk tokens."""

    def __init__(self, h, w, sl, C: int, rows: int, mdt, want: bool, write_e: bool, temperature: float,
                 need_s1: bool, slack: float, block: int | None):
        self.h, self.w, self.sl, self.C, self.mdt, self.write_e = h, w, sl, C, mdt, write_e
        self.z = torch.empty((min(C, h.shape[0]), w.shape[0]), dtype=mdt, device=h.device)
        self.ebuf = torch.empty((rows, w.shape[0]), dtype=h.dtype, device=h.device) if want else None
        self.T, self.block = float(temperature), block
        self.kw = dict(temperature=self.T, need_s1=need_s1, slack=slack, block=block)
        self.last = None  # the last sub-chunk's logits (two-pass: the whole super-chunk, C == S)

    def sweep(self, s0, s1, slc):
        e = None if self.ebuf is None else self.ebuf[: s1 - s0]
        zg = torch.empty((s1 - s0, self.sl.k1), dtype=self.mdt, device=self.h.device)
        stat = torch.empty((s1 - s0, 3), dtype=self.mdt, device=self.h.device)
        if self.w.shape[0] == 0:  # this rank's shard is all padding
            zg.fill_(float("-inf"))
            stat.copy_(torch.tensor([float("-inf"), 0.0, 0.0], dtype=self.mdt).expand(s1 - s0, 3))
            return e, zg, stat, None
        for c0 in range(s0, s1, self.C):
            c1 = min(s1, c0 + self.C)
            z = self.last = self.z[: c1 - c0]
            gemm.mm_into(self.h[c0:c1], self.w.t(), z)
            slot_gather_mask(z, self.sl.idx[c0:c1], out=zg[c0 - s0: c1 - s0])
            row_sweep(z, e[c0 - s0: c1 - s0] if self.write_e else None, zg[c0 - s0: c1 - s0],
                      out=stat[c0 - s0: c1 - s0], **self.kw)
        return e, zg, stat, None

    def dz(self, e, coef, need_b: bool):
        """Two-pass (one sub-chunk per super-chunk): e = A exp(u - lse) + B exp(z - lse1) with coef = (A, lse, B,
        lse1) per row."""
        row_grad(self.last, e, coef, self.T, need_b, self.block)
