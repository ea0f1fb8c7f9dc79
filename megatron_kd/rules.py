"""The rules that several layers apply, each written once: usable temperatures and when two are the same, the
teacher's K, the cache encoding a build defaults to, the padded vocabulary, when a cache's vocabulary fits a
student, a file's sha256, whether a directory has room for a write and whether a write failed for want of it.

Plain numbers and functions over the standard library (no torch, nothing of the package), so every layer, the
planner and the CLI import it without loading torch. Each rule answers a question; the caller words the message
in its own keys (a recipe key, a command-line flag, a Bridge field), so users read the names they typed.
"""
import errno
import hashlib
import math
import shutil

# Softmax temperatures that are usable: beyond the range logits / T overflow or the distribution is a one-hot /
# uniform. The one rule for the loss's temperature and cache_temperature, the teacher's top-K and cache manifests.
TEMPERATURE_RANGE = (1e-3, 1e3)

# Two temperatures within this relative tolerance are one: a manifest stores the float a recipe's YAML parsed, and
# a re-tempering recipe may spell it another way (0.7 vs 7e-1 vs 0.70000001).
TEMPERATURE_RTOL = 1e-6


def temperature_problem(t) -> str | None:
    """None when t is a usable softmax temperature, else what is wrong with it (a clause for a message)."""
    lo, hi = TEMPERATURE_RANGE
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and lo <= t <= hi):
        return f"must be a finite number in [{lo:g}, {hi:g}]"
    return None


def same_temperature(a, b) -> bool:
    """Whether a cache captured at temperature a serves a run that reads it at b."""
    return math.isclose(float(a), float(b), rel_tol=TEMPERATURE_RTOL)


# The teacher's top-K slots per position when nothing sets K: a cache build's --top-k and the planner's guess for a
# recipe whose kd.top_k takes a cache's K.
DEFAULT_TOP_K = 100


def top_k_fits(k, vocab_size=None) -> bool:
    """Whether k teacher slots per position are possible: at least one, at most the vocabulary (when known)."""
    return 1 <= int(k) and (vocab_size is None or int(k) <= int(vocab_size))


# The encoding a cache build uses when none is asked for and no setting implies one (cache/encoding/ holds the
# encodings and their own rules).
DEFAULT_ENCODING = "fp16"


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int = 1) -> int:
    """Megatron's padding: round up to a multiple of make_vocab_size_divisible_by x TP (every TP shard has the
    same width; the padding rows stay out of the loss)."""
    step = max(1, int(divisible_by)) * int(tp)
    return -(-int(vocab_size) // step) * step


def vocab_problem(cache_vocab: int, student_vocab: int, *, student_rows: bool = False) -> str | None:
    """None when a cache's top-K ids mean the same tokens for this student, else "differs" or "larger".

    The cache records the teacher's vocabulary without padding: the tokenizer's ids. Against the student's
    vocabulary without padding the two must be equal: top-K ids name the same tokens only under one tokenizer,
    and a smaller cache vocabulary (a 32,000-id tokenizer's cache for a 128,256-id student) is another tokenizer
    whose ids name other tokens. Where only the student's embedding rows are known (student_rows=True: a Bridge
    model config's vocab_size, which may pad past the tokenizer: Qwen2.5 has 151,936 rows for 151,665 tokens),
    equality cannot be asked; every cache id must still be a row of the student.
    """
    cache_vocab, student_vocab = int(cache_vocab), int(student_vocab)
    if student_rows:
        return "larger" if cache_vocab > student_vocab else None
    return "differs" if cache_vocab != student_vocab else None


def file_sha256(path, block: int = 1 << 24) -> str:
    """The hex sha256 of a file's bytes, read in blocks (cache shards, checkpoint files, tokenizer files)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(block)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


# A write that failed for want of room: the disk full, the user's quota spent, or a file-size limit reached
# (`ulimit -f`: "File too large"). Each means the same to the user: free space, or write somewhere else.
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def out_of_room(e: BaseException) -> bool:
    """True when `e` is a write that failed for want of room (NO_ROOM_ERRNOS)."""
    return isinstance(e, OSError) and e.errno in NO_ROOM_ERRNOS


def free_space(path, need: int) -> tuple[int, bool]:
    """(free bytes at path, whether a write of need bytes fits there): asked before a write that takes long, so it
    is refused before the work instead of failing with ENOSPC hours later."""
    free = shutil.disk_usage(path).free
    return free, free >= need
