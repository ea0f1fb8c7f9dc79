"""Buffer sizes and switches of the fused impl, without importing Triton (the memory planner reads them too).

DEFAULTS is the one line to edit after benchmarks/kernel_tune.py has ranked the alternatives on a GPU;
each key can be overridden by the environment variable MEGATRON_KD_FUSED_<KEY>.
"""
import os

MIB = 1 << 20
# Ranked first by kernel_tune.py on an H200, 2026-11-29 (benchmarks/results/kernel_tune_h200.json).
DEFAULTS = dict(Z_MIB=512, E_MIB=2048, A_MIB=0, OVERLAP="0", LOGITS="anchored", ROWS="kernel")


def _env(key: str) -> str:
    return os.environ.get("MEGATRON_KD_FUSED_" + key, str(DEFAULTS[key]))


Z_BYTES = int(_env("Z_MIB")) * MIB  # fp32 logits of one sub-chunk
E_BYTES = int(_env("E_MIB")) * MIB  # bf16 dz of one super-chunk
A_BYTES = int(_env("A_MIB")) * MIB  # bf16 anchored logits / E of one super-chunk; 0: 0.9 x |W| in bf16
OVERLAP = _env("OVERLAP") == "1"  # sweep on a side stream (CUDA)
LOGITS = _env("LOGITS")  # "anchored" | "fp32" | "bf16": how the logits GEMM writes for bf16 inputs (fused.py)
ROWS = _env("ROWS")  # "kernel" | "torch": the scaled path's per-row bookkeeping (fused.py, ops/scaled.py)
W_FRACTION = 0.9  # anchored buffer by default: this fraction of the bf16 weight's bytes (S = 0.9 H rows)


def anchored_rows(vocab: int, hidden: int, a_bytes: int | None = None) -> int:
    """Tokens per super-chunk of the anchored path: A_BYTES of buffer, or (A_MIB = 0) 0.9 x the bf16 weight
    gradient a plain implementation would allocate, so the loss never needs more than that. A multiple of 128
    (of 16 below 128): on an H200 at V=201088 a chunk of 2560 tokens ran the loss 3% faster than one of 2592
    (results/loss_rows_v201k_h200.json: 189.4 against 195.6 ms at N=32768), with less memory."""
    budget = A_BYTES if a_bytes is None else a_bytes
    budget = budget or int(W_FRACTION * 2 * vocab * hidden)
    rows = budget // (2 * max(1, vocab))
    return rows // 128 * 128 if rows >= 128 else max(16, rows // 16 * 16)
