"""What each quant.format is: ModelOpt's config of it, where ModelOpt runs it, what its quantizers hold (the planner
counts that), and the compressed-tensors scheme an export writes of it. One record per format, in one file each
(this folder). The recipe's checks, the quantizer (models/quant.py), the planner (plan/memory.py) and the export
(export/compressed.py) read these records by name; none of them keeps a table of its own. Plain data: nothing here
imports ModelOpt.

Adding a format: a file here defining FORMAT (a QuantFormat: its ModelOpt config's name, and what its quantizers
hold; `export` stays None where compressed-tensors has no exact form of it, and export then folds it), and its
module name in REGISTERED.
"""
import importlib
from dataclasses import dataclass
from typing import Callable, Optional

# one line per format, in the order they are offered: the module (this folder) that defines its FORMAT record
REGISTERED = (
    "none",
    "fp8",
    "int8",
    "int8_wo",
    "int4_awq",
    "w4a8_awq",
    "nvfp4",
)

AWQ_BLOCK = 128  # ModelOpt's INT4_AWQ_CFG block size along a weight's input dimension


def scheme_args(num_bits: int, kind: str, strategy: str, group_size=None) -> dict:
    """compressed-tensors' quantization arguments of one tensor (weights or input activations)."""
    a = {"num_bits": num_bits, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": False}
    if group_size:
        a["group_size"] = group_size
    return a


def awq_floats(i: int, o: int) -> int:
    """Per-block weight amax plus the AWQ pre-quant scale per input channel."""
    return o * -(-i // AWQ_BLOCK) + i


@dataclass(frozen=True)
class QuantFormat:
    """One quant.format. modelopt_config: the name of its config in modelopt.torch.quantization (None: no
    quantization). cuda_only: ModelOpt fake-quantizes it on CUDA tensors only. buffer_floats(in, out): the fp32
    numbers its quantizers keep for one linear layer of that shape (amax, AWQ scales). weight_bits: ModelOpt's
    num_bits of its weight quantizer. export: the compressed-tensors scheme that holds it exactly (storage format,
    weights, input activations), None where there is none. aliases: other names of the same format."""
    name: str
    modelopt_config: Optional[str]
    buffer_floats: Callable[[int, int], int]
    cuda_only: bool = False
    weight_bits: object = None
    export: Optional[dict] = None
    aliases: tuple = ()


FORMATS: dict = {}


def register(fmt: QuantFormat) -> QuantFormat:
    """Add a format (and its other names) to the registry."""
    for name in (fmt.name, *fmt.aliases):
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


for _module in REGISTERED:
    register(importlib.import_module(f"{__name__}.{_module}").FORMAT)
