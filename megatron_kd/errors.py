"""The package's exception types, in one place. Each message is one sentence that names what is wrong (the recipe
key, the file, the flag) and a fix that works; the CLI prints it without a traceback.

Every type derives from ValueError: bad input, found before the work that needs it wherever it can be.
"""


class RecipeError(ValueError):
    """A recipe problem, found before any work; the message names the key and the fix."""


class RunError(RecipeError):
    """A problem met while training (not in the recipe itself), reported like a recipe problem: one sentence."""


class CacheError(ValueError):
    """A teacher top-K cache problem: what is wrong with the cache (or its build) and how to fix it."""


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint that cannot be used as asked; the message names the key and the fix."""


class CorpusError(ValueError):
    """A corpus `data prepare` cannot tokenize as asked: the message names the file (and line) and the fix."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be used as given (not a file, no end-of-document token); names the flag that fixes it."""


class PruneError(ValueError):
    """A pruning that does not fit the checkpoint; found before anything is written."""
