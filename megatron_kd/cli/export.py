"""`megatron-kd export`: a trained student as a Hugging Face checkpoint transformers loads.

    megatron-kd export --checkpoint runs/my_run --out /models/my_student_hf
    megatron-kd export --checkpoint runs/my_run/iter_0000500 --out OUT --hf-path /models/Llama-3.2-3B

Reads the megatron-kd checkpoint (any TP/PP layout it was saved in; latest iteration of a save dir, or one
iter_* dir) and its recipe, builds the student on one process with the architecture of its Hugging Face source
(model.hf_path of the run, or --hf-path), and writes through Megatron-Bridge: config.json, *.safetensors in the
checkpoint's dtype (train.precision; --dtype to change it) and the source's tokenizer files. An existing
non-empty --out is kept unless --overwrite. Needs Megatron-Bridge (the NeMo container, or Python 3.12 with
megatron-bridge 0.6.2).

A student trained quantized (quant.format) is written as a compressed-tensors checkpoint where its format has one
(--quantized lists them: low-precision weights, their scales, static input scales), which transformers loads with
the compressed-tensors package and runs with the trained student's weight and activation quantization (docs/hf.md);
--quantized folded writes the plain checkpoint of its weights on the quantization grid instead (the only export
of the other formats and of MoE students).
"""
import argparse
import sys

DTYPES = ("auto", "fp32", "bf16", "fp16")
QUANTIZED = ("auto", "compressed-tensors", "folded")  # export/to_hf.QUANTIZED (not imported: --help loads no torch)


def _compressed_formats() -> str:
    """The quant.formats whose record (quant_formats/) names a compressed-tensors scheme."""
    from ..quant_formats import FORMATS
    return ", ".join(n for n, f in FORMATS.items() if f.export is not None)


def build_parser():
    p = argparse.ArgumentParser(prog="megatron-kd export", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--checkpoint", required=True, help="a `megatron-kd train` save dir (latest) or an iter_* dir")
    p.add_argument("--out", required=True, help="the Hugging Face directory to write")
    p.add_argument("--hf-path", default=None, help="the student's HF source (default: the run's model.hf_path)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="tensor dtype (auto: the checkpoint's)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quantized", choices=QUANTIZED, default="auto",
                   help="a student trained quantized (quant.format): compressed-tensors (a quantized checkpoint: "
                        "its low-precision weights, scales and input scales), folded (a plain checkpoint of its "
                        "weights on the quantization grid, without the activation quantization), auto (default): "
                        f"compressed-tensors where the student has that form ({_compressed_formats()}; "
                        "no MoE), folded otherwise")
    p.add_argument("--attention-backend", choices=("te", "sdpa", "local"), default=None,
                   help="the layer spec to build the student on (default: the one its checkpoint records; a "
                        "checkpoint of an older run records none, and the run's model.attention_backend applies)")
    return p


def _static_inputs(fmt: str) -> bool:
    """Whether the compressed-tensors export of quant.format `fmt` holds static input scales (its record says)."""
    from ..quant_formats import get
    return get(fmt).export["input_activations"] is not None


def main(argv=None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from ..runtime.quiet import quiet_megatron_warnings
    from ..export.to_hf import export  # not at import: `megatron-kd --help` loads no torch
    quiet_megatron_warnings()
    try:
        s = export(args.checkpoint, args.out, hf_path=args.hf_path, dtype=args.dtype, device=args.device,
                   overwrite=args.overwrite, quantized=args.quantized, attention_backend=args.attention_backend)
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-kd export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {s['out']}: the student of iteration {s['iteration']} as a Hugging Face checkpoint "
          f"({', '.join(s['files'])}) in {s['seconds']:.1f} s")
    if s.get("source_quantization"):  # e.g. GPT-OSS as published (MXFP4 experts): written dequantized
        print(s["source_quantization"])
    q = s.get("quantized")
    if q and q["export"] == "compressed-tensors":
        print(f"quantized as {q['format']}: a compressed-tensors checkpoint ({q['compressed_tensors_format']}: "
              f"{q['quantized_linears']} quantized Linear layers with their scales"
              + (" and static input scales" if _static_inputs(q["format"]) else "") + "); transformers loads it "
              "with the compressed-tensors package installed and gives the trained fake-quantized student's logits")
        for name, why in q["unquantized"].items():
            print(f"  {name}: written unquantized (its fake-quantized weight): {why}")
    elif q:
        if q.get("no_compressed_tensors"):
            print(f"no compressed-tensors export: {q['no_compressed_tensors']}")
        print(f"quantized as {q['format']}: written as its weights on that grid (AWQ input scales folded in), a "
              "checkpoint transformers loads unquantized" + (
                  f"; the activation quantizers ({', '.join(q['activation_quantizers_dropped'])}) are not part of "
                  "it" if q["activation_quantizers_dropped"] else ": the trained student's logits"))
    return 0
