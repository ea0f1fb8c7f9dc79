"""A `megatron-kd train` checkpoint's student as a Hugging Face checkpoint (behind `megatron-kd export`).

Reads the checkpoint (any TP/PP layout it was saved in; latest iteration of a save dir, or one iter_* dir) and its
recipe, builds the student on one process with the architecture of its Hugging Face source (model.hf_path of the
run, or hf_path), and writes through Megatron-Bridge (megatron_kd/hf): config.json, *.safetensors, tokenizer files.
"""
import os
import shutil
import time


def check_target(out: str, src: str, key: str, fix: str | None) -> bool:
    """An export's target directory: never the student's source checkpoint (checked first: --overwrite must not
    delete the source), and, when `fix` is given, holding nothing yet (else the error names `fix`). True when it
    holds files. key: how the errors name it ("--out ", "train.export_hf=")."""
    if os.path.realpath(out) == os.path.realpath(src):
        raise ValueError(f"{key}{out} is the student's source checkpoint {src}; write the export elsewhere")
    full = os.path.isdir(out) and bool(os.listdir(out))
    if full and fix:
        raise ValueError(f"{key}{out} exists and is not empty; {fix}")
    return full


def export(checkpoint: str, out: str, *, hf_path=None, dtype: str = "auto", device: str = "auto",
           overwrite: bool = False) -> dict:
    """The checkpoint's student -> `out` as an HF checkpoint; returns a summary. Errors are ValueError."""
    from ..hf import HFCheckpointError, check_hf_dir
    from ..checkpoint import store as ckpt
    from ..recipe.schema import ParallelConfig, to_recipe
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
    if check_target(out, src, "--out ", None if overwrite else "pass --overwrite to replace it, or choose another "
                    "directory"):
        shutil.rmtree(out)
    r.model.hf_path = src
    from ..runtime.dist import distributed
    from ..models.builder import build_hf_chunks
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
