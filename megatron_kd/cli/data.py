"""`megatron-kd data prepare`: tokenize text into Megatron's indexed .bin/.idx (megatron-core's IndexedDatasetBuilder).

    megatron-kd data prepare --pydoc --output-prefix data/pydoc_text_document --vocab-size 2048
    megatron-kd data prepare --input a.jsonl b.txt.gz --output-prefix data/mine --tokenizer /models/Llama-3.2-1B

Text: --pydoc (the documentation CPython ships), or --input files, each by its name:
  .jsonl / .json    one JSON object per line, the text under --json-key (default "text")
  .parquet          the column --json-key (needs pyarrow)
  .txt / .md        documents by --text-documents: blank-line (default: paragraphs separated by empty lines),
                    line (one per line) or file (the whole file)
  any of them gzipped (.gz)
Tokenizer: --tokenizer FILE or FOLDER (a `tokenizers` JSON file, or a Hugging Face model folder holding
tokenizer.json), or a byte-level BPE trained on the text (written to PREFIX.tokenizer.json). Each document ends
with the tokenizer's end-of-document token: --eod-token, else <|endoftext|> or <|end_of_text|> (Llama 3),
else tokenizer_config.json's eos_token.
--split (default 95,5,0, the split of the training command printed at the end): a corpus that leaves a part of
it without documents is refused, since megatron-core cannot build an empty part.
Nothing is downloaded. Existing outputs are kept unless --overwrite; one prepare per prefix at a time.
"""
import argparse
import sys

DEFAULT_SPLIT = "95,5,0"  # megatron_kd/recipes/data/pydoc.yaml's, which the printed next step trains with


def build_parser():
    p = argparse.ArgumentParser(prog="megatron-kd data", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("prepare", help="text -> .bin/.idx (+ PREFIX.tokenizer.json)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    src = q.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="FILE", help="corpus files (.jsonl .parquet .txt, or .gz)")
    src.add_argument("--pydoc", action="store_true", help="CPython's bundled documentation (pydoc_data.topics)")
    q.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    q.add_argument("--tokenizer", default=None,
                   help="a tokenizers JSON file or a Hugging Face model folder; default: train a byte-level BPE")
    q.add_argument("--eod-token", default=None, help="the token that ends each document (default: the tokenizer's)")
    q.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary when training one (default 4096)")
    q.add_argument("--json-key", default="text", help="the text's key in .jsonl, column in .parquet (default text)")
    q.add_argument("--text-documents", default="blank-line", choices=("blank-line", "line", "file"),
                   help="how a .txt splits into documents (default blank-line)")
    q.add_argument("--split", default=DEFAULT_SPLIT,
                   help=f"the data.split you will train with, checked for empty parts (default {DEFAULT_SPLIT})")
    q.add_argument("--overwrite", action="store_true", help="replace existing outputs of this prefix")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from ..runtime.interrupt import run_interruptible
    # SIGTERM / Ctrl-C unwind: the temporary files go, the outputs already there stay as they were
    return run_interruptible(lambda: prepare_command(args), f"nothing of {args.output_prefix} was changed",
                             "rerun the same command to prepare it")


def prepare_command(args) -> int:
    from ..runtime.quiet import quiet_megatron_warnings
    quiet_megatron_warnings()
    from ..data.corpus import prepare, pydoc_documents, read_documents, split_documents
    counts = {}
    try:
        if args.vocab_size < 2 and not args.tokenizer:
            raise ValueError(f"--vocab-size {args.vocab_size}: a trained tokenizer needs at least 2 ids, e.g. 4096")
        try:
            split_documents(1, args.split)  # before the inputs are read
        except ValueError:
            raise ValueError(f"--split {args.split}: give three non-negative weights (train, valid, test) with a "
                             "positive sum, e.g. 95,5,0") from None
        docs = pydoc_documents() if args.pydoc else read_documents(args.input, args.json_key, args.text_documents,
                                                                    counts)
        s = prepare(docs, args.output_prefix, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                    overwrite=args.overwrite, eod_token=args.eod_token, split=args.split)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"megatron-kd data prepare: error: {e}", file=sys.stderr)
        return 2
    for path, n in counts.items():
        print(f"{path}: {n} documents")
    parts = "/".join("-" if n is None else str(n) for n in s["split"]["documents"])
    print(f"wrote {s['bin']} / .idx: {s['documents']} documents (train/valid/test {parts} at split {args.split}), "
          f"{s['tokens']} tokens, vocabulary {s['vocab_size']}, each document ended by {s['eod_token']} "
          f"(id {s['eod_id']}) (tokenizer {s['tokenizer']})")
    print(next_step(args.output_prefix, s["tokenizer"], args.split, s["eod_id"] if args.eod_token else None))
    return 0


def next_step(prefix: str, tokenizer: str, split: str = DEFAULT_SPLIT, eod_id: int | None = None) -> str:
    import shlex
    extra = (f" data.split={shlex.quote(split)}" if split != DEFAULT_SPLIT else "") + \
        (f" data.eod_id={eod_id}" if eod_id is not None else "")
    return ("next: train on it, e.g. (CE only, no teacher; kd=offline adds a teacher cache)\n"
            f"  megatron-kd train --config-name tiny_cpu data=pydoc data.path={shlex.quote(prefix)} "
            f"data.tokenizer={shlex.quote(str(tokenizer))}{extra} kd=ce")
