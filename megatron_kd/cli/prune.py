"""`megatron-kd prune`: a smaller student from a Hugging Face checkpoint, by depth and/or MLP width.

    megatron-kd prune --hf TEACHER_DIR --out STUDENT_DIR --keep-layers 0,2,4,6
    megatron-kd prune --hf TEACHER_DIR --out STUDENT_DIR --ffn-size 4096

--keep-layers: the decoder layers kept (embedding, final norm and output layer are kept). --ffn-size: every
layer's MLP keeps the channels of largest weight importance (|gate_j| |up_j| |down_:,j|). Works on the files
(safetensors + config.json); the result loads in transformers and trains as model.hf_path.
"""
import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="megatron-kd prune", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--hf", required=True, metavar="DIR", help="the Hugging Face checkpoint folder to prune")
    p.add_argument("--out", required=True, metavar="DIR", help="the pruned checkpoint folder")
    p.add_argument("--keep-layers", metavar="LIST", help="layers to keep, e.g. 0,2,4-7")
    p.add_argument("--ffn-size", type=int, metavar="N", help="MLP width to keep in every layer")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    from ..errors import PruneError
    from ..hf.prune import prune
    try:
        s = prune(args.hf, args.out, keep_layers=args.keep_layers, ffn_size=args.ffn_size, overwrite=args.overwrite)
    except PruneError as e:
        print(f"megatron-kd prune: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {s['out']} ({s['family']}): layers {s['layers']}, intermediate_size {s['intermediate_size']}")
    print(f"next: train it as the student, e.g. model.hf_path={args.out}")
    return 0
