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
import sys

import torch

from .. import quant_formats
OUTPUT_LAYERS = ("output_layer", "lm_head")
STATE_KEY = "modelopt_state"  # the checkpoint's common-state key of the quantizers' structure
FORMAT_KEY = "quant_format"    # ... and of the format (also kept on the quantized module under this name)


def quant_config(fmt: str) -> dict:
    """A copy of ModelOpt's config of quant.format `fmt` (quant_formats/ names it)."""
    import modelopt.torch.quantization as mtq
    return copy.deepcopy(getattr(mtq, quant_formats.get(fmt).modelopt_config))


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
    # A quantizer can only exist once ModelOpt's module defining it has been imported (quantize and
    # restore_quantizers import it): looking it up instead of importing keeps every unquantized run, and every
    # install without the quant extra, free of ModelOpt and of the packages its import needs.
    nn = sys.modules.get("modelopt.torch.quantization.nn")
    return nn is not None and isinstance(m, nn.TensorQuantizer)


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


def _is_sequential(m) -> bool:  # a chain of quantizers on one tensor (w4a8_awq's int4 then fp8 weights)
    nn = sys.modules.get("modelopt.torch.quantization.nn")  # as _is_quantizer: no ModelOpt, no quantizer
    return nn is not None and isinstance(m, nn.SequentialQuantizer)


def _is_quantizer_key(key: str) -> bool:
    return any(part.endswith("_quantizer") for part in key.split("."))


def folded_state_dict(model: torch.nn.Module) -> dict:
    """The state dict of the unquantized model that multiplies by the weights `model`'s quantizers give: each
    quantized weight replaced by its fake-quantized value (on the format's grid, in the weight's dtype), an AWQ
    input scale (the input quantizer's pre_quant_scale, which multiplies the layer's input) folded into the
    weight's input columns, and the quantizers' own buffers left out. A plain model loading it reproduces the
    quantized model exactly for weight-only formats (int4_awq, w4a16_awq); the activation quantization of fp8,
    int8, w4a8_awq and nvfp4 has no place in a plain model and is not reproduced."""
    sd = {k: v for k, v in model.state_dict().items() if not _is_quantizer_key(k)}
    with torch.no_grad():
        for name, m in model.named_modules():
            wq = getattr(m, "weight_quantizer", None)
            held = isinstance(getattr(m, "weight", None), torch.Tensor)
            if not held or not (_is_quantizer(wq) or _is_sequential(wq)):
                continue  # not quantized, or a weight held elsewhere (the tied output layer's: left unquantized)
            iq = getattr(m, "input_quantizer", None)
            for q in (wq, iq):
                if q is not None and _is_quantizer(q) and getattr(q, "rotate_is_enabled", False):
                    raise ValueError(f"{name}: a rotating quantizer (Hadamard) cannot be folded into its weight")
            w = wq(m.weight)
            s = getattr(iq, "pre_quant_scale", None) if iq is not None and _is_quantizer(iq) else None
            if s is not None:  # y = (x * s) @ W^T = x @ (W * s)^T
                w = w * s.to(w.dtype).reshape(1, -1)
            sd[f"{name}.weight" if name else "weight"] = w.to(m.weight.dtype).clone()
    return sd


def activation_quantizers(model: torch.nn.Module) -> list:
    """The enabled quantizers a folded export does not reproduce (all but the weights')."""
    return [n for n in enabled_quantizers(model) if not any(p.endswith("weight_quantizer") for p in n.split("."))]
