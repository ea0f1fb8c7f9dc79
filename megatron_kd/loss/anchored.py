"""Anchored bf16 logits: the scaled path of impl="fused" without an fp32 logits buffer (bf16 inputs, TP = 1).

Per super-chunk of S tokens:
  1. an anchor per token, b = max of the student's logits at a few slot ids (teacher's top ids, the label),
     rounded to bf16 (any anchor is exact: the same b is subtracted and added back);
  2. one GEMM writes y^T = (z - b)^T [V, S] in bf16 (cuBLASLt bias epilogue: fp32 sum, one rounding);
  3. the slot kernel reads y at the slots and masks them; ops.cols.col_sweep turns y into E = exp(y / T) in
     place and returns sum(E) and max(y) per token. E = exp(u - a) with a = b / T: the scaled path's dz = s E.
bf16 keeps y to 2^-9 |y| relative, so where the softmax mass is (y near max y) the error stays below
TAU 2^-9 (0.8%) as long as max y <= TAU. A token whose max y (slots included) exceeds min(TAU, 60 T) (its
student ranks something far above its logits at the anchor ids; 60 T keeps y / T below the sweep's clamp), or
whose sum is not finite, is flagged on the device: its
row scale is set to 0, so it adds nothing to either gradient, and after the last chunk (one host sync per call)
the flagged tokens are recomputed alone with fp32 logits (fused.run on those rows). No per-chunk sync.
Memory: S x V bf16 (settings.anchored_rows: by default <= 0.9 x the bf16 weight, S <= 0.9 H) instead of fp32
sub-chunk logits plus the bf16 dz buffer.
"""
import torch

from ..kernels import gemm
from ..kernels.cols import anchor_logits, col_sweep
from ..kernels.rows import slot_gather_mask

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
    def __init__(self, rows: int, v: int, h: torch.Tensor):
        self.buf = torch.empty(rows * v, dtype=h.dtype, device=h.device)
        self.v = v

    def sweep(self, hs, w, idx, aidx, temperature):
        """(e [C, V] view of E, zg [C, K1] fp32 logits at the slots, stat [C, 3] = (a, sum E, 0), bad [C]).
        idx [C, K1] slot ids, aidx [C, J] the anchor slots' ids (anchor_ids)."""
        c = hs.shape[0]
        hs = hs if hs.stride(1) == 1 else hs.contiguous()  # the anchor kernel reads rows
        b = anchor_logits(hs, w, aidx)
        yt = self.buf[: self.v * c].view(self.v, c)
        gemm.mm_bias_t_into(w, hs, -b, yt)
        zg = torch.empty(idx.shape, dtype=torch.float32, device=hs.device)
        slot_gather_mask(yt.t(), idx, out=zg)
        s, ymax = col_sweep(yt, temperature)
        bf = b.float()
        lim = min(TAU, 60.0 * temperature)  # and y / T <= 60: the sweep's clamp at 80 never touches a kept row
        bad = (ymax > lim) | (zg.amax(1) > lim) | ~torch.isfinite(s)
        zg += bf[:, None]
        stat = torch.stack([bf / temperature, s, torch.zeros_like(s)], 1)
        return yt.t(), zg, stat, bad

