"""The shared limits of a tempered softmax over vocabulary shards: usable temperatures and the logits of one
chunk. Plain numbers and functions (no torch), so the planner and the CLI read them without loading torch."""
import math

# Softmax temperatures that are usable: beyond the range logits / T overflow or the distribution is a one-hot /
# uniform. The one rule for the loss's temperature and cache_temperature, the teacher's top-K and cache manifests.
TEMPERATURE_RANGE = (1e-3, 1e3)


def temperature_problem(t) -> str | None:
    """None when t is a usable softmax temperature, else what is wrong with it (a clause for a message)."""
    lo, hi = TEMPERATURE_RANGE
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and lo <= t <= hi):
        return f"must be a finite number in [{lo:g}, {hi:g}]"
    return None


# Logits of one chunk over a vocabulary shard: 2**26 elements (256 MiB in fp32). Big enough for efficient GEMMs,
# small enough that a chunked pass (the torch loss impls, the teacher's top-K) stays a few hundred MiB above its
# inputs. The planner counts the same chunk.
LOGITS_PER_CHUNK = 1 << 26


def rows_per_chunk(vocab_local: int) -> int:
    """Rows of a [rows, vocab_local] logit chunk that hold about LOGITS_PER_CHUNK elements (at least one)."""
    return max(1, LOGITS_PER_CHUNK // max(1, vocab_local))
