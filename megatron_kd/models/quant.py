"""Quantized students through NVIDIA ModelOpt (recipe section `quant`).

ModelOpt's fake quantization swaps each linear layer for a quantized one in place (megatron-core's parallel linears
through its megatron plugin, torch's nn.Linear directly): the weights stay in the training precision and gradients
flow through straight-through quantizers, so the quantized student trains as any student (QAT with kd=ce, QAD with
the teacher's top-K). The output layer keeps its weights unquantized (ModelOpt's configs leave *output_layer* and
*lm_head* off): the fused loss reads that weight directly, and it must equal what the model multiplies by.

Resume: the quantizers' structure and settings are ModelOpt's "modelopt state" (saved in the checkpoint's common
state); their calibrated values (amax, AWQ scales) are buffers of the model's state dict and travel with the weights.
"""
import copy

import torch

from ..recipe.schema import QUANT_FORMATS

# quant.format -> ModelOpt's config of that name (modelopt.torch.quantization)
CONFIGS = {"fp8": "FP8_DEFAULT_CFG", "int8": "INT8_DEFAULT_CFG", "int4_awq": "INT4_AWQ_CFG",
           "w4a16_awq": "INT4_AWQ_CFG", "w4a8_awq": "W4A8_AWQ_BETA_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}
assert set(CONFIGS) == set(QUANT_FORMATS) - {"none"}
OUTPUT_LAYERS = ("output_layer", "lm_head")
STATE_KEY = "modelopt_state"  # the checkpoint's common-state key of the quantizers' structure
FORMAT_KEY = "quant_format"    # ... and of the format (also kept on the quantized module under this name)


def quant_config(fmt: str) -> dict:
    import modelopt.torch.quantization as mtq
    return copy.deepcopy(getattr(mtq, CONFIGS[fmt]))


def quantize(model: torch.nn.Module, fmt: str, forward_loop) -> torch.nn.Module:
    """Quantize `model` in place as `fmt` and calibrate it: forward_loop(model) runs the calibration data through
    it (AWQ searches its scales there too). Returns the model."""
    import modelopt.torch.quantization as mtq
    mtq.quantize(model, quant_config(fmt), forward_loop)
    check_output_layer(model)
    setattr(model, FORMAT_KEY, fmt)
    return model


def is_quantized(model: torch.nn.Module) -> bool:
    return any(_is_quantizer(m) for m in model.modules())


def _is_quantizer(m) -> bool:
    from modelopt.torch.quantization.nn import TensorQuantizer
    return isinstance(m, TensorQuantizer)


def enabled_quantizers(model: torch.nn.Module) -> list:
    return [n for n, m in model.named_modules() if _is_quantizer(m) and m.is_enabled]


def check_output_layer(model: torch.nn.Module) -> None:
    """The fused loss multiplies the output layer's raw weight: a quantizer on it would train another model."""
    on = [n for n in enabled_quantizers(model) if any(o in n.split(".") for o in OUTPUT_LAYERS)]
    if on:
        raise ValueError(f"quantizers {on} are enabled on the output layer: the fused loss reads its weight "
                         "unquantized; leave *output_layer* / *lm_head* out of the quantization config")


def quantizer_state(model: torch.nn.Module) -> dict:
    """ModelOpt's state of `model` (which modules are quantized, and how); the values are in its state dict."""
    import modelopt.torch.opt as mto
    return mto.modelopt_state(model)


def restore_quantizers(model: torch.nn.Module, state: dict) -> torch.nn.Module:
    """Quantize `model` as `state` says, without calibration (a resume: load_state_dict brings the values)."""
    import modelopt.torch.opt as mto
    return mto.restore_from_modelopt_state(model, state)


def quantizer_bytes(model: torch.nn.Module) -> int:
    """Bytes of the quantizers' buffers (amax, AWQ pre-quant scales): what quantization adds to the model."""
    return sum(b.numel() * b.element_size() for m in model.modules() if _is_quantizer(m)
               for b in m.buffers(recurse=False))
