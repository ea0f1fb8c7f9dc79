"""A `megatron-kd train` checkpoint's student as a Hugging Face checkpoint (behind `megatron-kd export`).

Reads the checkpoint (any TP/PP layout it was saved in; latest iteration of a save dir, or one iter_* dir) and its
recipe, builds the student on one process with the architecture of its Hugging Face source (model.hf_path of the
run, or hf_path), and writes through Megatron-Bridge (megatron_kd/hf): config.json, *.safetensors, tokenizer files.
"""
import contextlib
import os
import shutil
import sys
import time

import torch.distributed as dist

from ..recipe.checks import check_target
from . import compressed
from ..runtime.dist import ENV_KEYS, free_port, restore_env


QUANTIZED = ("auto", "compressed-tensors", "folded")


def export(checkpoint: str, out: str, *, hf_path=None, dtype: str = "auto", device: str = "auto",
           overwrite: bool = False, quantized: str = "auto", attention_backend: str | None = None) -> dict:
    """The checkpoint's student -> `out` as an HF checkpoint; returns a summary. Errors are ValueError.
    Written beside `out`, then swapped in: a failed export leaves `out` (and everything else) as it was.
    quantized (a student trained with quant.format): compressed-tensors (a quantized checkpoint, export/
    compressed.py), folded (a plain checkpoint of its weights on the quantization grid), or auto: the first where
    the student has that form (its format's record names a compressed-tensors scheme; no MoE), else the second. The student is built on
    the layer spec its checkpoint records (checkpoint/spec.py; the run's attention_backend=auto would pick one by
    what imports here); attention_backend (te, sdpa, local) chooses it for a checkpoint that records none."""
    from ..checkpoint import spec as layer_spec
    from ..runtime.interrupt import is_interrupt
    if quantized not in QUANTIZED:
        raise ValueError(f"--quantized {quantized}: choose one of {', '.join(QUANTIZED)}")
    from ..hf import HFCheckpointError, check_hf_dir
    from ..checkpoint import layout as ckpt_layout
    from ..checkpoint import store as ckpt
    from ..recipe.schema import ParallelConfig, to_recipe
    if not os.path.isdir(checkpoint):
        raise ValueError(f"--checkpoint {checkpoint} is not a directory; give a `megatron-kd train` save dir "
                         "(train.save) or one of its iter_* directories")
    try:
        common = ckpt.read_common(checkpoint)
    except (FileNotFoundError, RuntimeError) as e:
        raise ValueError(f"--checkpoint {checkpoint}: {e}") from None
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        if is_interrupt(e):
            raise
        raise ValueError(f"--checkpoint {checkpoint}: its checkpoint cannot be read ({layer_spec.summary(e)}); give "
                         "a `megatron-kd train` save dir (train.save) or one of its iter_* directories") from None
    if "recipe" not in common:
        raise ValueError(f"--checkpoint {checkpoint} holds no recipe: not a `megatron-kd train` checkpoint")
    r = to_recipe(common["recipe"])
    src = hf_path or r.model.hf_path
    if not src:
        raise ValueError(f"--checkpoint {checkpoint}: the run's student did not start from a Hugging Face checkpoint "
                         "(model.hf_path is null); pass --hf-path, a Hugging Face directory of the same "
                         "architecture whose config and tokenizer the export should carry")
    check_hf_dir(src, "--hf-path" if hf_path else "model.hf_path")
    inputs = {"the checkpoint of --checkpoint": checkpoint,
              "the run (save dir) of --checkpoint": ckpt_layout.run_root(checkpoint)}
    check_target(out, src, "--out ", None if overwrite else "pass --overwrite to replace it, or choose another "
                 "directory", keep=inputs)
    r.model.hf_path = src
    names = (f"--checkpoint {checkpoint}", "--attention-backend {}")
    layer_spec.build_as_saved(common, r.model, attention_backend, *names)
    from ..runtime.dist import distributed
    from ..models.builder import build_hf_chunks
    from ..hf.model import DTYPES as TORCH_DTYPES
    from ..hf.model import open_hf
    single = ParallelConfig(tp=1, pp=1, ep=1, etp=1 if r.parallel.etp == 1 else None, use_distributed_optimizer=False)
    t0 = time.perf_counter()
    with written_beside(out) as tmp, distributed(single, r.train.seed, device):
        try:
            chunks, _ = build_hf_chunks(r.model, single, r.data.seq_length, r.train.precision, load_weights=False)
            iteration = ckpt.load_spec_weights(checkpoint, chunks, *names)
            torch_dtype = None if dtype == "auto" else TORCH_DTYPES[dtype]
            hf = open_hf(src, "model.hf_path")
            fmt = _quant_format(chunks)
            if fmt is None and quantized == "compressed-tensors":
                raise ValueError(f"--quantized compressed-tensors: the student of {checkpoint} is not quantized "
                                 "(its run had no quant.format); leave --quantized out")
            plans, refused = None, None
            if fmt is not None and quantized != "folded":
                try:
                    plans = [compressed.plan(c, fmt) for c in chunks]
                except compressed.Unsupported as e:
                    if quantized == "compressed-tensors":
                        raise
                    refused = e.reason  # auto: written folded, and export says why
            if plans is not None:
                chunks = _plain(r, single, [p.state for p in plans])
                hf.export(chunks, tmp, dtype=torch_dtype)
                summary = compressed.rewrite(tmp, hf, chunks, plans)
            else:
                chunks, summary = _fold_quantized(chunks, r, single, fmt)
                if refused:
                    summary["no_compressed_tensors"] = refused
                hf.export(chunks, tmp, dtype=torch_dtype)
        except HFCheckpointError as e:
            raise ValueError(str(e)) from None
        except (OSError, RuntimeError, KeyError) as e:  # a checkpoint or source the export cannot use
            raise ValueError(f"--checkpoint {checkpoint} could not be exported with --hf-path {src} "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); {out} is left as "
                             "it was") from None
    from ..hf.checks import quantization_note
    return {"out": out, "iteration": iteration, "source": src, "seconds": time.perf_counter() - t0,
            "files": sorted(os.listdir(out)), "quantized": summary, "source_quantization": quantization_note(src)}


def _quant_format(chunks):
    """The student's quant.format, or None for an unquantized one."""
    if "modelopt" not in sys.modules:  # nothing was quantized in this process (the checkpoint held no quantizers)
        return None
    from ..models import quant
    if not any(quant.is_quantized(c) for c in chunks):
        return None
    return getattr(chunks[0], quant.FORMAT_KEY, None)


def _plain(r, single, states):
    """The student's architecture unquantized, holding `states`."""
    from ..models.builder import build_hf_chunks
    plain, _ = build_hf_chunks(r.model, single, r.data.seq_length, r.train.precision, load_weights=False)
    for c, sd in zip(plain, states):
        c.load_state_dict(sd, strict=True)
    return plain


def _fold_quantized(chunks, r, single, fmt):
    """--quantized folded: a student trained quantized (quant.format) written as the plain model of its quantized
    weights: each weight on its format's grid, AWQ's input scales folded in (models/quant.folded_state_dict),
    which transformers loads as any checkpoint. The activation quantization of a format that has one is
    left out; weight-only formats give the trained fake-quantized student's logits. Returns the chunks to export
    and what was done (None for an unquantized student)."""
    if fmt is None:
        return chunks, None
    from ..models import quant
    acts = sorted({n.rsplit(".", 1)[-1] for c in chunks for n in quant.activation_quantizers(c)})
    plain = _plain(r, single, [quant.folded_state_dict(c) for c in chunks])
    return plain, {"format": fmt, "export": "folded", "activation_quantizers_dropped": acts}


@contextlib.contextmanager
def written_beside(out: str):
    """A temporary directory beside `out` to write into; on success it replaces `out` (the old one removed only
    then), on failure it is removed and `out` is left as it was. An flock beside `out` keeps a second writer of
    the same `out` out."""
    import fcntl
    out = os.path.abspath(out)
    parent, name = os.path.dirname(out), os.path.basename(out)
    os.makedirs(parent, exist_ok=True)
    lock = open(os.path.join(parent, f".{name}.lock"), "a+")
    try:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ValueError(f"another export is writing {out}; wait for it to end, or write to another "
                             "directory") from None
        tmp = os.path.join(parent, f".{name}.partial")
        shutil.rmtree(tmp, ignore_errors=True)  # a killed export's leftovers (the lock says none is running)
        os.makedirs(tmp)
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = os.path.join(parent, f".{name}.replaced")
        if os.path.isdir(out):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        lock.close()
        try:
            os.remove(os.path.join(parent, f".{name}.lock"))
        except OSError:
            pass


def export_at_end(save: str, out: str) -> str:
    """train.export_hf: `megatron-kd export` of the finished run on rank 0, as one process (the other ranks are
    done; the run's memory is freed). Written beside `out`, then swapped in (export): a killed export leaves no
    half-written `out`, and a rerun starts it over."""
    print(f"megatron-kd train: exporting the student to {out} (train.export_hf)", flush=True)
    env = {k: os.environ.get(k) for k in ENV_KEYS}
    if not dist.is_initialized():  # rank 0 alone: a one-process group of its own (torchrun's names restored after)
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        export(save, out)
    except Exception as e:
        raise RuntimeError(f"train.export_hf: the export failed ({e}); the run's checkpoint in {save} is complete: "
                           f"`megatron-kd export --checkpoint {save} --out {out}` retries it") from e
    finally:
        restore_env(env)
    return out
