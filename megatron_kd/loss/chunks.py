"""Settings and chunk plan of the fused impl, and the chunk size of the torch impls. No Triton here: the memory
planner (plan/memory.py) sizes the loss's buffers with the same functions the loss runs.

impl="fused" runs one of three loops (`fused_path`):
  anchored     bf16 inputs at TP=1 (the training default): S tokens per chunk of anchored bf16 logits, written
               by the logits GEMM and turned into E in place; no fp32 logits buffer (loss/logits.py).
  fp32_logits  fp32 / fp64 inputs at TP=1, or FusedSettings(logits="fp32"): sub-chunks of C tokens of fp32 logits
               fill a super-chunk of S tokens of E (C divides S).
  two_pass     TP > 1, fp16, tail != "none", CE at T != 1, negative weights, or no gradient wanted: C == S tokens
               of fp32 logits, a second sweep writes dz once the global statistics are known.
"""
from dataclasses import dataclass

import torch

from ..parallel.limits import rows_per_chunk
from .options import LossOptions

MIB = 1 << 20
LOGITS = ("anchored", "fp32")
PATHS = ("anchored", "fp32_logits", "two_pass")
W_FRACTION = 0.9  # anchored buffer by default: this fraction of the bf16 weight's bytes (S = 0.9 H rows)


@dataclass(frozen=True)
class FusedSettings:
    """How impl="fused" sizes its buffers and writes its logits; the defaults are the production settings (ranked
    first on an H200: benchmarks/results/kernel_tune_h200.json).

    logits      "anchored": with bf16 inputs at TP=1, anchored bf16 logits straight from the GEMM (S x V bf16,
                no fp32 logits); "fp32": fp32 sub-chunk logits there too (more memory, no fp32 redo of outliers).
    z_mib       fp32 logits of one sub-chunk (rows C = z / 4V).
    e_mib       bf16 E / dz of one super-chunk (rows S = e / 2V). Each super-chunk costs one fp32 read-modify-write
                of the weight-gradient accumulator and some small launches, so fewer, larger ones are faster.
    a_mib       anchored buffer; 0: 0.9 x the bf16 weight (anchored_rows).
    sub_rows, super_rows   C and S in tokens instead of the budgets (super_rows before LossOptions.chunk_size).
    block       Triton tile of the row kernels (None: autotuned on the GPU).
    """
    logits: str = "anchored"
    z_mib: int = 512
    e_mib: int = 2048
    a_mib: int = 0
    sub_rows: int | None = None
    super_rows: int | None = None
    block: int | None = None

    def __post_init__(self):
        if self.logits not in LOGITS:
            raise ValueError(f"FusedSettings(logits={self.logits!r}) is unknown; use one of {LOGITS}")
        for name in ("z_mib", "e_mib", "a_mib"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"FusedSettings({name}={getattr(self, name)}) must be >= 0 MiB")
        for name in ("sub_rows", "super_rows", "block"):
            v = getattr(self, name)
            if v is not None and int(v) < 1:
                raise ValueError(f"FusedSettings({name}={v}) must be a positive number (or None)")


@dataclass(frozen=True)
class ChunkPlan:
    path: str        # one of PATHS
    sub_rows: int    # C: tokens of one fp32 logits sub-chunk (anchored: == super_rows, and no fp32 buffer)
    super_rows: int  # S: tokens per super-chunk (E / dz buffer of S x V_local in the input dtype)


def fused_path(opts: LossOptions, tp: int, dtype: torch.dtype, settings: FusedSettings, vocab: int = 1,
               needs_grad: bool = True) -> str:
    """Which loop impl="fused" runs (module docstring). fp16 never takes the one-sweep paths: E = exp(u - a) may
    reach e^slack, beyond fp16's range."""
    scaled = (needs_grad and tp == 1 and opts.tail == "none" and opts.kl_weight >= 0 and opts.ce_weight >= 0
              and not opts.ce_untempered
              and dtype in (torch.bfloat16, torch.float32, torch.float64))
    if not scaled:
        return "two_pass"
    return "anchored" if settings.logits == "anchored" and dtype == torch.bfloat16 and vocab > 0 else "fp32_logits"


def _round(x: int, q: int) -> int:
    return max(q, x // q * q)


def anchored_rows(vocab: int, hidden: int, a_bytes: int = 0) -> int:
    """Tokens per super-chunk of the anchored path: a_bytes of buffer, or (0) 0.9 x the bf16 weight gradient a
    plain implementation would allocate, so the loss never needs more than that. A multiple of 128 (of 16 below
    128): GEMM tiles divide it, which measured faster than the odd size above it (benchmarks/README.md)."""
    budget = a_bytes or int(W_FRACTION * 2 * vocab * hidden)
    rows = budget // (2 * max(1, vocab))
    return rows // 128 * 128 if rows >= 128 else max(16, rows // 16 * 16)


def chunk_plan(vocab: int, hidden: int, *, tp: int = 1, dtype: torch.dtype = torch.bfloat16,
               opts: LossOptions = LossOptions(), settings: FusedSettings = FusedSettings(),
               needs_grad: bool = True) -> ChunkPlan:
    """The fused impl's path and chunk rows. vocab: the global valid vocabulary (rows follow it, so a TP rank's
    buffers shrink with its shard); the budgets hold at TP=1."""
    path = fused_path(opts, tp, dtype, settings, vocab, needs_grad)
    v = max(1, vocab)
    z, e = settings.z_mib * MIB, settings.e_mib * MIB
    sup = settings.super_rows or (int(opts.chunk_size) if opts.chunk_size else None)
    if path == "anchored":
        s = max(1, sup or anchored_rows(vocab, hidden, settings.a_mib * MIB))
        return ChunkPlan(path, s, s)
    if path == "two_pass":
        c = sup or settings.sub_rows or _round((z + e) // (6 * v), 16)
        return ChunkPlan(path, c, c)
    c = settings.sub_rows or _round(z // (4 * v), 16)
    s = sup or _round(e // (2 * v), c)
    c = min(c, s)
    return ChunkPlan(path, c, max(c, s // c * c))


def default_chunk_size(vocab_local: int) -> int:
    """Tokens per chunk of the torch impls (chunked, forward_chunked): LOGITS_PER_CHUNK fp32 logits, a power of
    two."""
    c = rows_per_chunk(vocab_local)
    return max(16, 1 << (c.bit_length() - 1))
