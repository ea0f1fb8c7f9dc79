"""`megatron-kd export`: a trained student as a Hugging Face checkpoint transformers loads.

    megatron-kd export --checkpoint runs/my_run --out /models/my_student_hf
    megatron-kd export --checkpoint runs/my_run/iter_0000500 --out OUT --hf-path /models/Llama-3.2-3B

Reads the megatron-kd checkpoint (any TP/PP layout it was saved in; latest iteration of a save dir, or one
iter_* dir) and its recipe, builds the student on one process with the architecture of its Hugging Face source
(model.hf_path of the run, or --hf-path), and writes through Megatron-Bridge: config.json, *.safetensors in the
checkpoint's dtype (train.precision; --dtype to change it) and the source's tokenizer files. An existing
non-empty --out is kept unless --overwrite. Needs Megatron-Bridge (the NeMo container, or Python 3.12 with
megatron-bridge 0.6.2).
"""
import argparse
import os
import shutil
import sys
import time

DTYPES = ("auto", "fp32", "bf16", "fp16")


def build_parser():
    p = argparse.ArgumentParser(prog="megatron-kd export", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--checkpoint", required=True, help="a `megatron-kd train` save dir (latest) or an iter_* dir")
    p.add_argument("--out", required=True, help="the Hugging Face directory to write")
    p.add_argument("--hf-path", default=None, help="the student's HF source (default: the run's model.hf_path)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="tensor dtype (auto: the checkpoint's)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def export(checkpoint: str, out: str, *, hf_path=None, dtype: str = "auto", device: str = "auto",
           overwrite: bool = False) -> dict:
    """The checkpoint's student -> `out` as an HF checkpoint; returns a summary. Errors are ValueError."""
    from ..hf import HFCheckpointError, check_hf_dir
    from ..megatron import checkpoint as ckpt
    from ..megatron.config import ParallelConfig, to_recipe
    try:
        common = ckpt.read_common(checkpoint)
    except (FileNotFoundError, RuntimeError) as e:
        raise ValueError(f"--checkpoint {checkpoint}: {e}") from None
    if "recipe" not in common:
        raise ValueError(f"--checkpoint {checkpoint} holds no recipe: not a `megatron-kd train` checkpoint")
    r = to_recipe(common["recipe"])
    src = hf_path or r.model.hf_path
    if not src:
        raise ValueError(f"--checkpoint {checkpoint}: the run's student did not start from a Hugging Face checkpoint "
                         "(model.hf_path is null); pass --hf-path, a Hugging Face directory of the same "
                         "architecture whose config and tokenizer the export should carry")
    check_hf_dir(src, "--hf-path" if hf_path else "model.hf_path")
    if os.path.isdir(out) and os.listdir(out):
        if not overwrite:
            raise ValueError(f"--out {out} exists and is not empty; pass --overwrite to replace it, or choose "
                             "another directory")
        shutil.rmtree(out)
    if os.path.realpath(out) == os.path.realpath(src):
        raise ValueError(f"--out {out} is the source checkpoint {src}; write the export elsewhere")
    r.model.hf_path = src
    from ..megatron.dist import distributed
    from ..megatron.model import build_hf_chunks
    from ..hf.model import DTYPES as TORCH_DTYPES
    from ..hf.recipe import open_hf
    single = ParallelConfig(tp=1, pp=1, ep=1, etp=1 if r.parallel.etp == 1 else None, use_distributed_optimizer=False)
    t0 = time.perf_counter()
    with distributed(single, r.train.seed, device):
        try:
            chunks, _ = build_hf_chunks(r.model, single, r.data.seq_length, r.train.precision, load_weights=False)
            iteration = ckpt.load_weights(checkpoint, chunks)
            torch_dtype = None if dtype == "auto" else TORCH_DTYPES[dtype]
            open_hf(src, "model.hf_path").export(chunks, out, dtype=torch_dtype)
        except HFCheckpointError as e:
            raise ValueError(str(e)) from None
    return {"out": out, "iteration": iteration, "source": src, "seconds": time.perf_counter() - t0,
            "files": sorted(os.listdir(out))}


def main(argv=None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from ..megatron import quiet_megatron_warnings
    quiet_megatron_warnings()
    try:
        s = export(args.checkpoint, args.out, hf_path=args.hf_path, dtype=args.dtype, device=args.device,
                   overwrite=args.overwrite)
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-kd export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {s['out']}: the student of iteration {s['iteration']} as a Hugging Face checkpoint "
          f"({', '.join(s['files'])}) in {s['seconds']:.1f} s")
    return 0
