"""`megatron-kd data prepare`: tokenize text into Megatron's indexed .bin/.idx (megatron-core's IndexedDatasetBuilder).

    megatron-kd data prepare --pydoc --output-prefix data/pydoc_text_document --vocab-size 2048
    megatron-kd data prepare --input a.jsonl b.jsonl --output-prefix data/my_text_document --tokenizer tok.json

Text: --pydoc (the documentation CPython ships), or --input files (.jsonl: one document per line under
--json-key; other files: one document each). Tokenizer: --tokenizer FILE (a `tokenizers` JSON file with an
<|endoftext|> token), or a byte-level BPE trained on the text (written to tokenizer.json beside the output).
Nothing is downloaded. Existing outputs are kept unless --overwrite.
"""
import argparse
import sys


def build_parser():
    p = argparse.ArgumentParser(prog="megatron-kd data", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("prepare", help="text -> .bin/.idx (+ tokenizer.json)")
    src = q.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="FILE", help="text files (.jsonl: one document per line)")
    src.add_argument("--pydoc", action="store_true", help="CPython's bundled documentation (pydoc_data.topics)")
    q.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    q.add_argument("--tokenizer", default=None, help="a tokenizers JSON file; default: train a byte-level BPE")
    q.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary when training one (default 4096)")
    q.add_argument("--json-key", default="text", help="JSON field holding the text in .jsonl input (default text)")
    q.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from ..runtime.quiet import quiet_megatron_warnings
    quiet_megatron_warnings()
    from ..data.corpus import prepare, pydoc_documents, read_documents
    try:
        docs = pydoc_documents() if args.pydoc else read_documents(args.input, args.json_key)
        s = prepare(docs, args.output_prefix, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                    overwrite=args.overwrite)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"megatron-kd data prepare: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {s['bin']} / .idx: {s['documents']} documents, {s['tokens']} tokens, vocabulary "
          f"{s['vocab_size']} (tokenizer {s['tokenizer']})")
    print(next_step(args.output_prefix, s["tokenizer"]))
    return 0


def next_step(prefix: str, tokenizer: str) -> str:
    import shlex
    return ("next: train on it, e.g. (CE only, no teacher; kd=offline adds a teacher cache)\n"
            f"  megatron-kd train --config-name tiny_cpu data=pydoc data.path={shlex.quote(prefix)} "
            f"data.tokenizer={shlex.quote(str(tokenizer))} kd=ce")
