"""The optional extras of the package (pyproject.toml's optional-dependencies), in one place: which extra brings
which module, and the one sentence a user gets when a feature asks for a module that does not import.

A base install (`pip install megatron-kd`, torch present) runs every command that needs no extra; each extra is
imported only where its feature runs. `missing` answers before any work whether a feature's module imports here, and
names the feature, the key that asked for it and the install that brings it. It really imports the module: a package
that is installed but cannot import (ModelOpt without one of its own dependencies) is as missing as an absent one.
"""
import importlib

# extra -> (module its features import, what it is)
EXTRAS = {
    "quant": ("modelopt.torch.quantization", "NVIDIA ModelOpt"),
    "parquet": ("pyarrow.parquet", "pyarrow"),
    "eval": ("lm_eval", "lm-evaluation-harness"),
    "te": ("transformer_engine.pytorch", "Transformer Engine"),
    "bridge": ("megatron.bridge", "Megatron-Bridge"),
    "kernels": ("triton", "Triton"),
}


def install_hint(extra: str) -> str:
    return f"pip install 'megatron-kd[{extra}]'"


def import_error(extra: str) -> str | None:
    """Why the extra's module does not import here (the exception, one line), or None when it imports."""
    module = EXTRAS[extra][0]
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a package whose own import fails (missing dependency, no CUDA)
        first = str(e).splitlines()[0] if str(e) else ""
        return f"{type(e).__name__}: {first}"
    return None


def missing(extra: str, feature: str, key: str) -> str | None:
    """One sentence when `feature` (asked for by `key`) cannot run because the `extra`'s module does not import,
    else None. Example: missing("quant", "fake-quantized students", "quant.format=fp8")."""
    why = import_error(extra)
    if why is None:
        return None
    name = EXTRAS[extra][1]
    return (f"{key}: {feature} need {name}, which does not import here ({why}); {install_hint(extra)} brings it, "
            f"or unset {key.split('=')[0]}")
