"""Text -> Megatron's indexed dataset (.bin/.idx) with a local or freshly trained `tokenizers` tokenizer.

Nothing is downloaded: the text comes from files, or from the documentation CPython ships in `pydoc_data`
(about 0.5 MB of English prose and code), and the tokenizer is a local file or a byte-level BPE trained here.
"""
import json
import os

import numpy as np

from ..cache.hashing import tokenizer_id

EOD = "<|endoftext|>"


def pydoc_documents() -> list:
    """CPython's documentation topics (pydoc_data.topics), one document each, in a fixed order."""
    from pydoc_data.topics import topics
    return [topics[k].strip() for k in sorted(topics) if topics[k].strip()]


def read_documents(paths, json_key: str = "text") -> list:
    """.jsonl: one document per line (its `json_key`); any other file: one document."""
    docs = []
    for p in paths:
        if p.endswith((".jsonl", ".json")):
            with open(p, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            docs.append(json.loads(line)[json_key])
                        except (ValueError, KeyError) as e:
                            raise ValueError(f"{p}:{n}: not a JSON object with a {json_key!r} string ({e})") from None
        else:
            with open(p, encoding="utf-8") as f:
                docs.append(f.read())
    return [d for d in docs if d.strip()]


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


def write_indexed(docs, tokenizer_path: str, prefix: str) -> dict:
    """Tokenize docs (each followed by <|endoftext|>) into prefix.bin / prefix.idx; returns a summary."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer_path)
    eod = tok.token_to_id(EOD)
    if eod is None:
        raise ValueError(f"{tokenizer_path} has no {EOD} token to end documents with")
    vocab = tok.get_vocab_size()
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab))
    tokens = 0
    for enc in tok.encode_batch(list(docs)):
        ids = enc.ids + [eod]
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
        tokens += len(ids)
    builder.finalize(prefix + ".idx")
    sha = tokenizer_id(tokenizer_path)
    return {"documents": len(docs), "tokens": tokens, "vocab_size": vocab, "eod_id": eod,
            "tokenizer": os.path.abspath(tokenizer_path), "tokenizer_sha256": sha,
            "bin": os.path.abspath(prefix + ".bin"), "idx": os.path.abspath(prefix + ".idx")}


def outputs(prefix: str, tokenizer_out: str | None) -> list:
    out = [prefix + ".bin", prefix + ".idx", prefix + ".json"]
    return out + ([tokenizer_out] if tokenizer_out else [])


def prepare(docs, prefix: str, *, tokenizer: str | None = None, vocab_size: int = 4096,
            overwrite: bool = False) -> dict:
    """docs -> prefix.{bin,idx,json} (+ prefix's dir/tokenizer.json when training one). Refuses to replace
    existing outputs unless overwrite."""
    d = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(d, exist_ok=True)
    tok_out = None if tokenizer else os.path.join(d, "tokenizer.json")
    existing = [p for p in outputs(prefix, tok_out) if os.path.exists(p)]
    if existing and not overwrite:
        raise FileExistsError(f"{', '.join(existing)} already exist; pass --overwrite to replace them, or choose "
                              "another --output-prefix")
    if not docs:
        raise ValueError("no documents to tokenize")
    tok_path = tokenizer or train_tokenizer(docs, vocab_size, tok_out)
    summary = write_indexed(docs, tok_path, prefix)
    lengths = np.array([len(x) for x in docs])
    summary["characters"] = int(lengths.sum())
    with open(prefix + ".json", "w") as f:
        json.dump(summary, f, indent=2)
    return summary
