"""Which tokenizer file a path names and which token ends its documents: one rule for `data prepare` and training.

A path is a `tokenizers` JSON file or a Hugging Face model folder holding tokenizer.json. The end-of-document
token is the one named (`--eod-token`), else the first of END_OF_DOCUMENT the vocabulary has (GPT-2, Qwen and
o200k end documents with <|endoftext|>, Llama 3 with <|end_of_text|>), else tokenizer_config.json's eos_token.
"""
import json
import os

from ..errors import TokenizerError

END_OF_DOCUMENT = ("<|endoftext|>", "<|end_of_text|>")



def tokenizer_file(path: str) -> str:
    """The tokenizers JSON file `path` names (a folder: its tokenizer.json)."""
    f = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(f):
        where = f"{path} has no tokenizer.json" if os.path.isdir(path) else f"{path} does not exist"
        raise TokenizerError(f"tokenizer {where}; give a `tokenizers` JSON file or a Hugging Face model folder "
                             "holding tokenizer.json (or leave --tokenizer out to train a byte-level BPE)")
    return f


def load(path: str):
    """(tokenizers.Tokenizer, its file) of `path`, refused in one sentence when it is not one."""
    from tokenizers import Tokenizer
    f = tokenizer_file(path)
    try:
        return Tokenizer.from_file(f), f
    except Exception as e:  # tokenizers raises its own Exception type for a file it cannot parse
        raise TokenizerError(f"{f} is not a `tokenizers` JSON file ({str(e).splitlines()[0][:120]}); give the "
                             "tokenizer.json of a Hugging Face model folder, or the folder itself") from None


def _config_eos(f: str):
    cfg = os.path.join(os.path.dirname(f), "tokenizer_config.json")
    try:
        with open(cfg, encoding="utf-8") as fh:
            eos = json.load(fh).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def special_tokens(tok) -> list:
    return sorted(t.content for t in tok.get_added_tokens_decoder().values() if t.special)


def end_of_document(tok, f: str, name: str | None = None) -> tuple:
    """(token, id) that ends each document of a corpus tokenized with `tok` (loaded from file f)."""
    if name is not None:
        i = tok.token_to_id(name)
        if i is None:
            raise TokenizerError(f"--eod-token {name!r} is not in the vocabulary of {f}; its special tokens: "
                                 f"{', '.join(special_tokens(tok)) or 'none'}")
        return name, int(i)
    for t in (*END_OF_DOCUMENT, _config_eos(f)):
        if t is not None and tok.token_to_id(t) is not None:
            return t, int(tok.token_to_id(t))
    raise TokenizerError(f"{f} has none of {', '.join(END_OF_DOCUMENT)} and no eos_token in a tokenizer_config.json "
                         f"beside it to end documents with; name one with --eod-token TOKEN (its special tokens: "
                         f"{', '.join(special_tokens(tok)) or 'none'})")
