"""Text -> Megatron's indexed dataset (.bin/.idx) with a local or freshly trained `tokenizers` tokenizer.

Nothing is downloaded: the text comes from files, or from the documentation CPython ships in `pydoc_data`
(about 0.5 MB of English prose and code), and the tokenizer is a local file (or Hugging Face model folder) or a
byte-level BPE trained here.

Corpus files, by name: .jsonl / .json (one JSON object per line, the text under `json_key`), .parquet (the column
`json_key`; needs pyarrow), .txt / .md / .text (documents split by `text_documents`: "blank-line": paragraphs
separated by one or more empty lines; "line": one per line; "file": the whole file), each also gzipped (.gz).
"""
import contextlib
import gzip
import json
import os
import sys

import numpy as np

from ..cache.fsio import try_lock
from ..errors import CorpusError
from ..rules import out_of_room
from ..cache.hashing import tokenizer_id
from .tokenizer import end_of_document, load

EOD = "<|endoftext|>"
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text", ".md")
TEXT_RULES = ("blank-line", "line", "file")
FORMATS = ("JSONL (.jsonl/.json, one object per line), Parquet (.parquet), text (.txt/.md/.text), each of them "
           "optionally gzipped (.gz)")



def pydoc_documents() -> list:
    """CPython's documentation topics (pydoc_data.topics), one document each, in a fixed order."""
    from pydoc_data.topics import topics
    return [topics[k].strip() for k in sorted(topics) if topics[k].strip()]


def _kind(path: str) -> str:
    name = path.lower()[:-3] if path.lower().endswith(".gz") else path.lower()
    if name.endswith(JSON_SUFFIXES):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    raise CorpusError(f"{path}: unknown corpus format (by its name); formats: {FORMATS}")


def _open_text(path: str):
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"  # by content: a .jsonl that is in fact gzipped reads too
    return gzip.open(path, "rt", encoding="utf-8") if gz else open(path, encoding="utf-8")


def _text_lines(path: str):
    """(line number, line) of a text or JSONL file, plain or gzipped; bytes that are not UTF-8 are refused."""
    n = 0
    try:
        with _open_text(path) as f:
            for n, line in enumerate(f, 1):
                yield n, line
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: line {n + 1} is not UTF-8 text ({e.reason} at byte {e.start}); formats: "
                          f"{FORMATS}") from None
    except (OSError, EOFError) as e:  # a truncated or damaged .gz
        raise CorpusError(f"{path}: cannot be read ({e}); formats: {FORMATS}") from None


def _json_documents(path: str, key: str) -> list:
    docs = []
    for n, line in _text_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise CorpusError(f"{path}: line {n} is not JSON ({e}); JSONL holds one JSON object per line") from None
        if not isinstance(obj, dict):
            raise CorpusError(f"{path}: line {n} is a JSON {type(obj).__name__}, not an object with a {key!r} "
                              "string; JSONL holds one JSON object per line")
        if key not in obj:
            keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
            raise CorpusError(f"{path}: line {n} has no {key!r} key (its keys: {keys}); name the text's key with "
                              "--json-key KEY")
        if not isinstance(obj[key], str):
            raise CorpusError(f"{path}: line {n}: {key!r} is a JSON {type(obj[key]).__name__}, not a string; "
                              f"fix that line or name the text's key with --json-key KEY")
        docs.append(obj[key])
    return docs


def _parquet_documents(path: str, key: str) -> list:
    from ..runtime.extras import missing
    why = missing("parquet", "Parquet corpora", path)
    if why:
        raise CorpusError(why)
    import pyarrow.parquet as pq
    try:
        f = pq.ParquetFile(gzip.open(path) if path.lower().endswith(".gz") else path)
        names = f.schema_arrow.names
        if key not in names:
            raise CorpusError(f"{path} has no column {key!r} (its columns: {', '.join(map(repr, names))}); name the text's "
                              "column with --json-key COLUMN")
        col = f.read(columns=[key]).column(key)
    except CorpusError:
        raise
    except Exception as e:  # pyarrow's ArrowInvalid and friends: not a Parquet file
        raise CorpusError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0][:120]}); formats: "
                          f"{FORMATS}") from None
    import pyarrow as pa
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise CorpusError(f"{path}: column {key!r} holds {col.type}, not strings; name the text's column with "
                          "--json-key COLUMN")
    return [d for d in col.to_pylist() if d is not None]


def _text_documents(path: str, rule: str) -> list:
    lines = [line for _, line in _text_lines(path)]
    if rule == "file":
        return ["".join(lines)]
    if rule == "line":
        return [line.rstrip("\n") for line in lines]
    docs, cur = [], []
    for line in lines + ["\n"]:
        if line.strip():
            cur.append(line)
        elif cur:
            docs.append("".join(cur).rstrip("\n"))
            cur = []
    return docs


def read_documents(paths, json_key: str = "text", text_documents: str = "blank-line", counts: dict | None = None):
    """Documents of the corpus files `paths` (formats: the module's docstring), in order; empty ones dropped.
    counts, when given, receives each file's number of documents."""
    if text_documents not in TEXT_RULES:
        raise CorpusError(f"text_documents={text_documents!r}: use one of {', '.join(TEXT_RULES)}")
    for p in paths:  # every name checked before any file is read
        if os.path.isdir(p) or not os.path.isfile(p):
            raise CorpusError(f"{p}: {'is a folder' if os.path.isdir(p) else 'no such file'}; give corpus files "
                              f"({FORMATS})")
        _kind(p)
    docs = []
    for p in paths:
        kind = _kind(p)
        got = (_json_documents(p, json_key) if kind == "json" else _parquet_documents(p, json_key)
               if kind == "parquet" else _text_documents(p, text_documents))
        got = [d for d in got if d.strip()]
        if counts is not None:
            counts[p] = len(got)
        docs += got
    return docs


def split_documents(num_documents: int, split: str) -> list:
    """Documents in each part (train, valid, test) of a data.split, as megatron-core's dataset builder cuts them;
    None for a part of share 0."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)
    import math
    try:
        w = [float(x) for x in str(split).replace("/", ",").split(",")]
    except ValueError:
        w = []
    if not (1 <= len(w) <= 3 and all(math.isfinite(x) and x >= 0 for x in w) and sum(w) > 0):
        raise CorpusError(f"split {split!r} is not three non-negative weights such as 95,5,0")
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(str(split)))
    return [None if m is None else int(round(m[1] * num_documents)) - int(round(m[0] * num_documents))
            for m in matrix]


def check_split(num_documents: int, split: str) -> list:
    """Refuses a corpus that leaves a part of `split` with no document (megatron-core's sampler then never ends)."""
    parts = split_documents(num_documents, split)
    empty = [name for name, n in zip(("train", "valid", "test"), parts) if n == 0]
    if empty:
        shown = "/".join("-" if n is None else str(n) for n in parts)
        raise CorpusError(
            f"{num_documents} document{'s' * (num_documents != 1)} found: split {split} gives the {' and '.join(empty)} "
            f"part{'s' * (len(empty) > 1)} 0 of them (train/valid/test {shown}), and megatron-core cannot build an "
            "empty part; give more documents (a .txt: --text-documents line splits it per line), or pass the "
            "data.split you will train with, e.g. --split 100,0,0")
    return parts


def train_tokenizer(docs, vocab_size: int, path: str) -> str:
    """Byte-level BPE (GPT-2 style) with <|endoftext|> as id 0, trained on docs, saved to path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer, length=len(docs))
    tok.save(path)
    return path


def write_indexed(docs, tokenizer_path: str, prefix: str, eod_token: str | None = None) -> dict:
    """Tokenize docs (each followed by the end-of-document token) into prefix.bin / prefix.idx; returns a
    summary (paths in it are `prefix`'s)."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    tok, f = load(tokenizer_path)
    eod_name, eod = end_of_document(tok, f, eod_token)
    vocab = tok.get_vocab_size()
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab))
    tokens = 0
    for enc in tok.encode_batch(list(docs)):
        ids = enc.ids + [eod]
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
        tokens += len(ids)
    builder.finalize(prefix + ".idx")
    return {"documents": len(docs), "tokens": tokens, "vocab_size": vocab, "eod_id": eod, "eod_token": eod_name,
            "tokenizer": os.path.abspath(f), "tokenizer_sha256": tokenizer_id(f)}


def _remove_leftovers(prefix: str) -> None:
    """The temporary files of a prepare of `prefix` that was killed (SIGKILL, or SIGTERM, which runs no cleanup);
    called under the prefix's lock, so no prepare is writing them."""
    d, name = os.path.split(os.path.abspath(prefix))
    for f in os.listdir(d):
        rest = f[len(name) + 4:] if f.startswith(name + ".tmp") else ""
        pid = rest.split(".", 1)[0]
        if pid.isdigit() and rest[len(pid):] in (".bin", ".idx", ".json", ".tokenizer.json"):
            os.remove(os.path.join(d, f))


def moving_marker(prefix: str) -> str:
    """The file a prepare writes before it moves its finished outputs into place, removed once they all are: while
    it is there, `prefix`'s outputs may be part the earlier prepare's, part this one's (a prepare killed mid-move)."""
    d, name = os.path.split(os.path.abspath(prefix))
    return os.path.join(d, f".{name}.prepare.moving")


def _move_into_place(prefix: str, moves: list) -> None:
    """Every (temporary, output) pair moved, as one step as far as a reader or a rerun can tell: the marker lists
    them first (a prepare killed between two moves is finished by the next prepare of `prefix`, _finish_moves; a
    training run refuses the prefix until then), and SIGTERM / SIGINT wait until the moves are done."""
    import signal
    marker = moving_marker(prefix)
    held = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        with open(marker + ".tmp", "w") as f:
            json.dump(moves, f)
        os.replace(marker + ".tmp", marker)
        for src, dst in moves:
            os.replace(src, dst)
        os.remove(marker)
        while signal.sigtimedwait(held, 0) is not None:
            pass  # a stop asked for during the moves comes after them: the prepare has finished, it ends as such
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def _finish_moves(prefix: str) -> bool:
    """The moves of a prepare of `prefix` killed while moving its outputs into place, finished (each file was
    complete before the first move): its outputs, none of the earlier ones mixed in. True when there were any."""
    marker = moving_marker(prefix)
    if os.path.exists(marker + ".tmp"):  # killed while listing the moves: none had started
        os.remove(marker + ".tmp")
    if not os.path.exists(marker):
        return False
    with open(marker) as f:
        moves = json.load(f)
    for src, dst in moves:
        if os.path.exists(src):
            os.replace(src, dst)
    os.remove(marker)
    return True


def outputs(prefix: str, tokenizer_out: str | None) -> list:
    out = [prefix + ".bin", prefix + ".idx", prefix + ".json"]
    return out + ([tokenizer_out] if tokenizer_out else [])


@contextlib.contextmanager
def _prefix_lock(prefix: str):
    """One `data prepare` per output prefix at a time: an flock the kernel drops when the process dies."""
    d, name = os.path.split(os.path.abspath(prefix))
    fd = try_lock(os.path.join(d, f".{name}.prepare.lock"))
    if fd is None:
        raise CorpusError(f"another data prepare is writing {prefix}; wait for it to finish, or choose another "
                          "--output-prefix") from None
    try:
        yield
    finally:
        os.close(fd)


def prepare(docs, prefix: str, *, tokenizer: str | None = None, vocab_size: int = 4096, overwrite: bool = False,
            eod_token: str | None = None, split: str | None = None, tokenizer_out: str | None = None) -> dict:
    """docs -> prefix.{bin,idx,json} (+ tokenizer_out, default prefix.tokenizer.json, when training a tokenizer).

    Refuses to replace existing outputs unless overwrite, a second writer of the same prefix while one runs, and
    (with `split`) a corpus too small for that data.split. Everything is written beside under temporary names and
    moved into place at the end, the .json last: an interrupted run leaves the previous outputs as they were."""
    if not os.path.basename(prefix) or os.path.isdir(prefix):
        raise CorpusError(f"--output-prefix {prefix} is a folder; give a file prefix inside it, e.g. "
                          f"{os.path.join(prefix, 'corpus')}")
    if prefix.endswith((".bin", ".idx")):
        raise CorpusError(f"--output-prefix {prefix}: give the prefix without .bin / .idx ({prefix[:-4]})")
    d = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(d, exist_ok=True)
    tok_out = None if tokenizer else (tokenizer_out or prefix + ".tokenizer.json")
    with _prefix_lock(prefix):
        if _finish_moves(prefix):
            print(f"note: a data prepare of {prefix} was stopped while moving its outputs into place; its move is "
                  "finished", file=sys.stderr)
        existing = [p for p in outputs(prefix, tok_out) if os.path.exists(p)]
        if existing and not overwrite:
            raise FileExistsError(f"{', '.join(existing)} already exist; pass --overwrite to replace them, or "
                                  "choose another --output-prefix")
        if not docs:
            raise CorpusError("no documents to tokenize: every input is empty or whitespace; give files that hold text")
        if tokenizer:
            tok, f = load(tokenizer)  # refused before any work: a bad file or no end-of-document token
            end_of_document(tok, f, eod_token)
        if split is not None:
            check_split(len(docs), split)
        _remove_leftovers(prefix)
        tmp = f"{prefix}.tmp{os.getpid()}"
        tmp_tok = None if tokenizer else tmp + ".tokenizer.json"
        try:
            tok_path = tokenizer or train_tokenizer(docs, vocab_size, tmp_tok)
            summary = write_indexed(docs, tok_path, tmp, eod_token)
            if tmp_tok:
                summary["tokenizer"] = os.path.abspath(tok_out)
            summary["characters"] = int(np.array([len(x) for x in docs]).sum())
            summary.update(bin=os.path.abspath(prefix + ".bin"), idx=os.path.abspath(prefix + ".idx"))
            if split is not None:
                summary["split"] = {"split": split, "documents": split_documents(len(docs), split)}
            with open(tmp + ".json", "w") as fh:
                json.dump(summary, fh, indent=2)
            # every file written before any is moved: a failed write leaves the previous outputs as they were
            _move_into_place(prefix, [*([(tmp_tok, tok_out)] if tmp_tok else []),
                                      *[(tmp + ext, prefix + ext) for ext in (".bin", ".idx", ".json")]])
        except OSError as e:
            if not out_of_room(e):
                raise
            raise CorpusError(f"no room left to write {prefix}.bin / .idx ({e.strerror or e}: the disk is full, or a quota or "
                              f"a file-size limit is reached) and nothing of {prefix} was changed; free space there "
                              "or give an --output-prefix on a disk with room, then rerun") from None
        finally:
            moving = os.path.exists(moving_marker(prefix))  # a move that failed half-way: the next prepare ends it
            for p in (tmp + ".bin", tmp + ".idx", tmp + ".json", tmp_tok):
                if p and os.path.exists(p) and not moving:
                    os.remove(p)
    return summary
