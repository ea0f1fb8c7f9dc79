"""The logits of one chunk over a vocabulary shard. Plain numbers and functions (no torch), so the planner and the
CLI read them without loading torch. (Usable temperatures are a rule of megatron_kd.rules.)"""

# Logits of one chunk over a vocabulary shard: 2**26 elements (256 MiB in fp32). Big enough for efficient GEMMs,
# small enough that a chunked pass (the torch loss impls, the teacher's top-K) stays a few hundred MiB above its
# inputs. The planner counts the same chunk.
LOGITS_PER_CHUNK = 1 << 26


def rows_per_chunk(vocab_local: int) -> int:
    """Rows of a [rows, vocab_local] logit chunk that hold about LOGITS_PER_CHUNK elements (at least one)."""
    return max(1, LOGITS_PER_CHUNK // max(1, vocab_local))
