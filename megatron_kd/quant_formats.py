"""What each quant.format is, in one place: ModelOpt's config of it, where ModelOpt runs it, what its quantizers
hold (the planner counts that), and the compressed-tensors scheme an export writes of it. The recipe's checks,
the quantizer (models/quant.py), the planner (plan/memory.py) and the export (export/compressed.py) read these
records by name; none of them keeps a table of its own. Plain data: nothing here imports ModelOpt.

A new format is one QuantFormat record below, registered with `register`: its ModelOpt config's name, and what
its quantizers hold; `export` stays None where compressed-tensors has no exact form of it (export then folds it).
"""
from dataclasses import dataclass
from typing import Callable, Optional

AWQ_BLOCK = 128  # ModelOpt's INT4_AWQ_CFG block size along a weight's input dimension


def _args(num_bits: int, kind: str, strategy: str, group_size=None) -> dict:
    a = {"num_bits": num_bits, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": False}
    if group_size:
        a["group_size"] = group_size
    return a


@dataclass(frozen=True)
class QuantFormat:
    """One quant.format. modelopt_config: the name of its config in modelopt.torch.quantization (None: no
    quantization). cuda_only: ModelOpt fake-quantizes it on CUDA tensors only. buffer_floats(in, out): the fp32
    numbers its quantizers keep for one linear layer of that shape (amax, AWQ scales). weight_bits: ModelOpt's
    num_bits of its weight quantizer. export: the compressed-tensors scheme that holds it exactly (storage format,
    weights, input activations), None where there is none."""
    name: str
    modelopt_config: Optional[str]
    buffer_floats: Callable[[int, int], int]
    cuda_only: bool = False
    weight_bits: object = None
    export: Optional[dict] = None


FORMATS: dict = {}


def register(fmt: QuantFormat, *aliases: str) -> QuantFormat:
    """Add a format (and other names of the same one) to the registry."""
    for name in (fmt.name, *aliases):
        FORMATS[name] = fmt
    return fmt


def names() -> tuple:
    return tuple(FORMATS)


def get(name: str) -> QuantFormat:
    """The record of quant.format `name` (KeyError: unknown; unknown_problem says it to the user)."""
    return FORMATS[name]


def unknown_problem(name, key: str = "quant.format") -> str | None:
    """The sentence that refuses an unregistered format, naming `key` and the registered ones (None: known)."""
    return None if name in FORMATS else f"{key}={name!r}: use one of {', '.join(FORMATS)}"


def _awq(i: int, o: int) -> int:  # per-block weight amax plus the AWQ pre-quant scale per input channel
    return o * -(-i // AWQ_BLOCK) + i


register(QuantFormat("none", None, lambda i, o: 0))
# per-tensor amax of weights and inputs
register(QuantFormat("fp8", "FP8_DEFAULT_CFG", lambda i, o: 2, weight_bits=(4, 3),
                     export={"format": "float-quantized", "weights": _args(8, "float", "tensor"),
                             "input_activations": _args(8, "float", "tensor")}))
# per-output-channel weight amax, per-tensor input amax
register(QuantFormat("int8", "INT8_DEFAULT_CFG", lambda i, o: o + 1, weight_bits=8,
                     export={"format": "int-quantized", "weights": _args(8, "int", "channel"),
                             "input_activations": _args(8, "int", "tensor")}))
# 4-bit weights, 16-bit activations: w4a16_awq is its other name
register(QuantFormat("int4_awq", "INT4_AWQ_CFG", _awq, weight_bits=4,
                     export={"format": "pack-quantized", "weights": _args(4, "int", "group", AWQ_BLOCK),
                             "input_activations": None}), "w4a16_awq")
# int4 weights then a second, fp8 per-tensor weight stage, and fp8 activations
register(QuantFormat("w4a8_awq", "W4A8_AWQ_BETA_CFG", lambda i, o: _awq(i, o) + 2))
# per-tensor amax (its block scales are computed on the fly)
register(QuantFormat("nvfp4", "NVFP4_DEFAULT_CFG", lambda i, o: 2, cuda_only=True))
