"""A student trained quantized (quant.format) as a compressed-tensors checkpoint: the quantized Hugging Face format
transformers loads through its CompressedTensorsHfQuantizer (with the `compressed-tensors` package), also vLLM's.
Dense GPT students (no MoE).

Why not ModelOpt's own export: it marks its checkpoints `quant_method: "modelopt"`, which transformers has no
quantizer for (5.17; 5.25, the newest, neither); it skips the quantization and reads the stored low-precision
weights without their scales, or fails on packed int4 shapes. compressed-tensors stores the same things (low-precision weights, their scales, the
static input scales) under a method transformers runs, on a CPU too: each quantized Linear dequantizes its weight
and fake-quantizes its input with the stored input scale in forward, which is what the trained student's quantizers
do. So the export holds exactly the trained student's quantized values, read off its ModelOpt quantizers, in the
scheme its format's record (quant_formats/) names; for example:

- fp8: FP8 (E4M3) weights with a per-tensor scale and a static per-tensor FP8 input scale (amax / 448 each);
- int8: INT8 weights with per-channel scales and a static per-tensor INT8 input scale (amax / 127);
- int4_awq (w4a16_awq): INT4 weights in groups of 128 with a scale per group (amax / 7), packed 8 to an int32.

AWQ's input scales (an input quantizer's pre_quant_scale, which multiplies the layer's input) have no place in the
format and are folded into what makes that input, so the export computes the same function: the qkv and fc1 scales
into the RMSNorm / LayerNorm weight before them, linear_proj's into the rows of V (when each query group's heads
share one scale, as their common V head requires), linear_fc2's into the rows of fc1's `up` half (gated MLPs).
Scaling a weight's rows scales its group scales and leaves its int4 values as they are. A layer whose scale cannot
be folded so is written unquantized (its fake-quantized weight with the scale folded into its input columns) and
named in the config's `ignore` list with the layers that were never quantized (the output layer).

The codes and scales are made in Megatron's layout and carried to Hugging Face's by Megatron-Bridge's own parameter
mappings (hf/model.py: HFModel.convert), the ones that write the weights; the dense weights Bridge writes are the
check: each quantized weight's codes times its scales must give them back.
"""
import json
import os

import torch

from .. import quant_formats

GROUP = quant_formats.AWQ_BLOCK
# quant.format -> the compressed-tensors scheme that holds it exactly (storage format, weights, input activations)
# and ModelOpt's num_bits of its weight quantizer (checked in _weight_codes): quant_formats/' records
SCHEMES = {n: f.export for n, f in quant_formats.FORMATS.items() if f.export is not None}
_BITS = {n: quant_formats.get(n).weight_bits for n in SCHEMES}
_RANGE = {8: (-128, 127), 4: (-8, 7)}
_TINY = 1.0 / (1 << 24)  # ModelOpt: an amax at or below this quantizes to zero


def supported(fmt) -> bool:
    return fmt in SCHEMES


class Unsupported(ValueError):
    """The student has no exact compressed-tensors form here (--quantized auto then writes it folded).
    reason: why, without the fix (what `export` reports when auto falls back)."""

    def __init__(self, reason: str, fix: str):
        super().__init__(f"{reason}; {fix}")
        self.reason = reason


def _unsupported(name: str, why: str) -> Unsupported:
    return Unsupported(f"{name}: {why}", "export it with --quantized folded (its weights on the quantization grid, "
                       "unquantized) instead")


def _is_tq(q) -> bool:
    from modelopt.torch.quantization.nn import TensorQuantizer
    return isinstance(q, TensorQuantizer)


def _step(q, amax_shape_ok, name: str) -> torch.Tensor:
    """The quantizer's step (amax / maxbound), as ModelOpt computes it: 1 / (maxbound / amax), in fp32."""
    amax = getattr(q, "amax", None)
    if amax is None or not amax_shape_ok(amax):
        raise _unsupported(name, f"its quantizer's amax {None if amax is None else tuple(amax.shape)} is not laid "
                                 "out as this format's compressed-tensors scales")
    amax = amax.detach().float()
    step = 1.0 / (float(q.maxbound) / amax)
    return torch.where(amax <= _TINY, torch.ones_like(step), step)


def expand(step: torch.Tensor, shape) -> torch.Tensor:
    """A step of [1, 1] (tensor), [rows, 1] (channel) or [rows, cols / 128] (group) to the weight's shape."""
    rows, cols = shape
    return step.repeat_interleave(cols // step.shape[1], dim=1).expand(rows, cols)


def _weight_codes(m, fmt: str, name: str):
    """(codes, step) of module m's weight: codes (int8, or float8_e4m3fn for fp8) times step (fp32: [1, 1],
    [rows, 1] or [rows, cols / 128]; see expand) gives the fake-quantized weight."""
    wq, w = m.weight_quantizer, m.weight
    if not _is_tq(wq) or not wq.is_enabled or getattr(wq, "rotate_is_enabled", False) or wq.num_bits != _BITS[fmt] \
            or wq.unsigned or getattr(wq, "_pre_quant_scale", None) is not None or w.dim() != 2:
        raise _unsupported(name, f"its weight quantizer is not {fmt}'s as ModelOpt's config sets it")
    out, cols = w.shape
    scheme = SCHEMES[fmt]["weights"]  # the record's: one step per tensor, per output channel or per group
    if scheme["strategy"] == "tensor":
        step = _step(wq, lambda a: a.numel() == 1, name).reshape(1, 1)
    elif scheme["strategy"] == "channel":
        step = _step(wq, lambda a: a.numel() == out and wq.axis in (0, (0,)), name).reshape(out, 1)
    else:
        if wq.block_sizes is None or wq.block_sizes.get(-1) != GROUP or cols % GROUP:
            raise _unsupported(name, f"its weight is not quantized in groups of {GROUP} along its {cols} inputs")
        step = _step(wq, lambda a: a.numel() == out * cols // GROUP, name).reshape(out, cols // GROUP)
    with torch.no_grad():  # in fp32: ModelOpt quantizes in fp32 and rounds the result to the weight's dtype
        fq = wq(w.detach().float()).float()
    full = expand(step, fq.shape)
    if scheme["type"] == "float":
        codes = (fq / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    else:
        lo, hi = _RANGE[wq.num_bits]
        codes = (fq / full).round().clamp(lo, hi).to(torch.int8)
    bad = (codes.float() * full - fq).abs() > 4 * torch.finfo(torch.float32).eps * fq.abs()
    if bad.any():  # not the format's grid: the quantizer is not what this module understands
        raise _unsupported(name, f"its fake-quantized weight is not codes x scales of {fmt} "
                                 f"({int(bad.sum())} of {bad.numel()} values)")
    return codes, step


def _input_step(m, fmt: str, name: str):
    """The static input scale (fp8, int8), or None (weight-only formats: int8_wo, int4_awq; their input quantizer
    must be off)."""
    iq = getattr(m, "input_quantizer", None)
    on = iq is not None and _is_tq(iq) and iq.is_enabled
    if SCHEMES[fmt]["input_activations"] is None:
        if on:
            raise _unsupported(name, f"its input quantizer is on, which {fmt} leaves off")
        return None
    # narrow_range: ModelOpt's int8 would stop at -127 where compressed-tensors' goes on to -128
    if not on or iq.num_bits != _BITS[fmt] or iq.unsigned or getattr(iq, "rotate_is_enabled", False) \
            or getattr(iq, "_pre_quant_scale", None) is not None or getattr(iq, "narrow_range", False):
        raise _unsupported(name, f"its input quantizer is not {fmt}'s static per-tensor one")
    return float(_step(iq, lambda a: a.numel() == 1, name))


def _pre_quant_scale(m):
    iq = getattr(m, "input_quantizer", None)
    s = getattr(iq, "pre_quant_scale", None) if iq is not None and _is_tq(iq) else None
    return None if s is None else s.detach().float().reshape(-1)


class Plan:
    """What the export of one quantized chunk holds: for each quantized Linear (Megatron name) its codes, step and
    input step; the Linears written unquantized (name -> why), and the state dict of the plain model that computes
    the same (quantized weights as codes x steps, the AWQ scales folded in)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.linears = {}   # module name -> {"codes", "step", "input_step", "pqs"}
        self.dense = {}     # module name -> why it is written unquantized
        self.state = {}


def plan(chunk, fmt: str) -> Plan:
    """The compressed-tensors export of chunk, quantized (models/quant.quantize) as `fmt`."""
    from ..models import quant
    if not supported(fmt):
        raise Unsupported(f"quant.format={fmt} has no compressed-tensors form that reproduces it here "
                          f"({', '.join(sorted(SCHEMES))} have)", "export it with --quantized folded")
    config = chunk.config
    if getattr(config, "num_moe_experts", None):
        raise _unsupported("the student", "its MoE layers have no compressed-tensors export here")
    p = Plan(fmt)
    state = {k: v for k, v in chunk.state_dict().items() if not quant._is_quantizer_key(k)}
    mods = dict(chunk.named_modules())
    for name, m in mods.items():
        wq = getattr(m, "weight_quantizer", None)
        if wq is None or not isinstance(getattr(m, "weight", None), torch.Tensor):
            continue  # not quantized, or a weight held elsewhere (the tied output layer's, left unquantized)
        if not (quant._is_quantizer(wq) and wq.is_enabled) and not quant._is_sequential(wq):
            continue
        codes, step = _weight_codes(m, fmt, name)
        p.linears[name] = {"codes": codes, "step": step, "input_step": _input_step(m, fmt, name),
                           "pqs": _pre_quant_scale(m)}
    for name in list(p.linears):
        _fold_awq(p, mods, name, config, state)
    for name, e in p.linears.items():
        state[f"{name}.weight"] = dequantized(e).to(mods[name].weight.dtype)
    p.state = state
    return p


def dequantized(e) -> torch.Tensor:
    return e["codes"].float() * expand(e["step"], e["codes"].shape)


def _fold_awq(p: Plan, mods: dict, name: str, config, state: dict) -> None:
    """Fold Linear `name`'s AWQ input scale s (y = (x * s) W^T) into what makes its input x, or write the Linear
    unquantized."""
    e = p.linears[name]
    s = e.pop("pqs")
    if s is None:
        return
    parent, kind = name.rsplit(".", 1) if "." in name else ("", name)
    block = parent.rsplit(".", 1)[0]  # the TransformerLayer (decoder.layers.N)
    if kind in ("linear_qkv", "linear_fc1"):
        why = _fold_into_norm(mods, name, block, kind, s, config, state)
    elif kind == "linear_proj":
        rows = _v_rows(s, config)
        why = "the query heads of one group, which share a V head, have different AWQ scales" if rows is None \
            else _fold_into_rows(p, mods, f"{parent}.linear_qkv", rows, state)
    elif kind == "linear_fc2" and getattr(config, "gated_linear_unit", False):
        # Megatron's gated fc1 is [gate; up]: act(gate) * up * s = act(gate) * (up * s)
        why = _fold_into_rows(p, mods, f"{parent}.linear_fc1", torch.cat([torch.ones_like(s), s]), state)
    else:
        why = "no linear map before it takes its AWQ scale"
    if why:  # its fake-quantized weight with s in its input columns: the same function, unquantized
        p.dense[name] = why
        del p.linears[name]
        state[f"{name}.weight"] = (dequantized(e) * s.reshape(1, -1)).to(mods[name].weight.dtype)


def _fold_into_norm(mods, name, block, kind, s, config, state):
    """x = norm(h) * gamma (+ beta) feeds only this Linear: x * s = norm(h) * (gamma * s) (+ beta * s)."""
    if getattr(config, "layernorm_zero_centered_gamma", False):
        return "its norm stores gamma - 1 (zero-centered gamma)"
    if isinstance(getattr(mods[name], "layer_norm_weight", None), torch.Tensor):  # TE: the norm inside the Linear
        keys = (f"{name}.layer_norm_weight", f"{name}.layer_norm_bias")
    else:
        norm = f"{block}.{'input_layernorm' if kind == 'linear_qkv' else 'pre_mlp_layernorm'}"
        keys = (f"{norm}.weight", f"{norm}.bias")
    if keys[0] not in state:
        return "no norm weight before it"
    for k in keys:
        if state.get(k) is not None:
            state[k] = (state[k].float() * s).to(state[k].dtype)
    return None


def _v_rows(s, config):
    """linear_proj's inputs are the heads' attention outputs, linear in V; head h reads V head h // (heads /
    groups). Its scale folds into V's rows when the heads of a group share it: the row scales of linear_qkv
    (Megatron's rows: per query group its q heads, then k, then v), else None."""
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    s3 = s.reshape(groups, heads // groups, -1)
    if not torch.equal(s3, s3[:, :1].expand_as(s3)):
        return None
    rows = torch.ones(groups, heads // groups + 2, s3.shape[-1])
    rows[:, -1] = s3[:, 0]
    return rows.reshape(-1)


def _fold_into_rows(p: Plan, mods, target: str, rows: torch.Tensor, state: dict):
    """Scale the output rows (and bias) of Linear `target`. Quantized, it keeps its codes and its row / group
    steps scale; a per-tensor step cannot take a per-row scale."""
    if target not in mods or f"{target}.weight" not in state:
        return f"no {target} before it"
    if target in p.linears:
        if SCHEMES[p.fmt]["weights"]["strategy"] == "tensor":
            return f"{target} has one scale for all its rows"
        p.linears[target]["step"] = p.linears[target]["step"] * rows.reshape(-1, 1)  # [rows, 1] or [rows, groups]
    else:  # unquantized (written dense)
        w = state[f"{target}.weight"]
        state[f"{target}.weight"] = (w.float() * rows.reshape(-1, 1)).to(w.dtype)
    b = state.get(f"{target}.bias")
    if b is not None:
        state[f"{target}.bias"] = (b.float() * rows).to(b.dtype)
    return None


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized layout of int4 codes [rows, cols]: each run of 8 values (plus 8, so
    0..15) in one int32, the first in the lowest 4 bits."""
    rows, cols = codes.shape
    if cols % 8:
        raise ValueError(f"int4 packing needs a multiple of 8 inputs, got {cols}")
    v = (codes.to(torch.int64) + 8).reshape(rows, cols // 8, 8)
    word = (v << (4 * torch.arange(8, dtype=torch.int64))).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def _compact(full: torch.Tensor, groups: int) -> torch.Tensor:
    """A step as Bridge's mapping gave it (the HF weight's shape) back to [rows or 1, groups], checking that the
    mapping moved whole rows only (each row's groups still share their step)."""
    rows, cols = full.shape
    small = full[:, ::cols // groups].contiguous()
    if not torch.equal(expand(small, full.shape), full):
        raise ValueError("Megatron-Bridge's mapping of a quantized weight does not keep its rows whole; its "
                         "scales cannot follow it")
    return small


def hf_tensors(hf, chunks, plans) -> tuple[dict, dict]:
    """Each quantized HF Linear's codes, steps and input step (module name -> {"codes", "step", "input_step"}),
    and the HF names of the Linears written unquantized (name -> why), through Bridge's own mappings."""
    if len(chunks) != 1:
        raise ValueError("the compressed-tensors export reads one model chunk (no virtual pipeline)")
    p = plans[0]
    scheme = SCHEMES[p.fmt]
    entries = {f"{n}.weight": e for n, e in p.linears.items()}
    out = {}
    for pname, d in hf.convert(chunks, lambda n: entries[n]["codes"].float() if n in entries else None):
        e = entries[pname]
        for k, c in d.items():
            mod = k[:-len(".weight")]
            c = c.to(e["codes"].dtype).contiguous()
            out[mod] = {"codes": c, "input_step": e["input_step"]}
    for pname, d in hf.convert(chunks, lambda n: expand(entries[n]["step"], entries[n]["codes"].shape).contiguous()
                               if n in entries else None):
        for k, st in d.items():
            out[k[:-len(".weight")]]["step"] = _compact(st.float(), entries[pname]["step"].shape[1])
    weights = {f"{n}.weight": n for n in p.dense}
    shapes = {k: v.shape for k, v in p.state.items() if k in weights}
    dense = {}
    for pname, d in hf.convert(chunks, lambda n: torch.zeros(shapes[n]) if n in weights else None):
        for k in d:
            dense[k[:-len(".weight")]] = p.dense[weights[pname]]
    for mod, t in out.items():
        if scheme["weights"]["strategy"] == "tensor":  # one step for the tensor: one value
            st = t["step"]
            if not bool((st == st.reshape(-1)[0]).all()):
                raise ValueError(f"{mod}: its rows have different steps, which a per-tensor scale cannot hold")
            t["step"] = st.reshape(-1)[:1].clone()
    return out, dense


def ct_tensors(t: dict, fmt: str) -> dict:
    """One quantized Linear's compressed-tensors tensors (names after the module's) from its codes and steps."""
    codes, step = t["codes"], t["step"]
    if SCHEMES[fmt]["format"] == "pack-quantized":
        d = {"weight_packed": pack_int4(codes), "weight_shape": torch.tensor(list(codes.shape), dtype=torch.int64)}
    else:
        d = {"weight": codes}
    d["weight_scale"] = step
    if t["input_step"] is not None:
        d["input_scale"] = torch.tensor([t["input_step"]], dtype=torch.float32)
    return d


def hf_linears(out: str) -> list:
    """The nn.Linear modules of the HF model in `out` (built on the meta device from its config.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def quantization_config(fmt: str, ignore: list) -> dict:
    """config.json's quantization_config: one group of every Linear but those in `ignore`, as llm-compressor
    writes it (transformers' CompressedTensorsConfig and vLLM read it)."""
    scheme = SCHEMES[fmt]
    return {"quant_method": "compressed-tensors", "format": scheme["format"], "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(scheme["weights"]),
                                          "input_activations": scheme["input_activations"] and
                                          dict(scheme["input_activations"]),
                                          "output_activations": None, "format": scheme["format"]}},
            "ignore": sorted(ignore), "kv_cache_scheme": None, "global_compression_ratio": None}


def rewrite(out: str, hf, chunks, plans) -> dict:
    """The dense export Bridge wrote in `out` (chunks holding plans[i].state) made a compressed-tensors checkpoint:
    each quantized weight replaced by its codes and scales (and input scale), quantization_config in config.json.
    Returns a summary: format, quantized and unquantized Linears."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    fmt = plans[0].fmt
    tensors, dense = hf_tensors(hf, chunks, plans)
    linears = hf_linears(out)
    missing = sorted(set(tensors) - set(linears))
    if missing:
        raise ValueError(f"quantized weights {missing[:3]} are not Linear modules of the Hugging Face model")
    index = os.path.join(out, "model.safetensors.index.json")
    weight_map = json.load(open(index))["weight_map"] if os.path.isfile(index) else None
    seen = set()
    for f in sorted(x for x in os.listdir(out) if x.endswith(".safetensors")):
        path = os.path.join(out, f)
        with safe_open(path, "pt") as fh:
            meta = fh.metadata()
        sd, new = load_file(path), {}
        for k, v in sd.items():
            mod = k[:-len(".weight")] if k.endswith(".weight") else None
            if mod not in tensors:
                new[k] = v
                continue
            e = tensors[mod]
            deq = (e["codes"].float() * expand(e["step"].reshape(-1, e["step"].shape[-1]), e["codes"].shape))
            # the weight Bridge wrote, to the rounding of the export's dtype: else the mapping moved it elsewhere
            if deq.shape != v.shape or ((deq - v.float()).abs() > 2 ** -7 * v.float().abs() + 1e-30).any():
                raise ValueError(f"{k}: its codes x scales do not give the weight Bridge exported")
            t = ct_tensors(e, fmt)
            for name, x in t.items():
                new[f"{mod}.{name}"] = x
                if weight_map is not None:
                    weight_map[f"{mod}.{name}"] = f
            if weight_map is not None and "weight" not in t:
                weight_map.pop(k, None)
            seen.add(mod)
        save_file(new, path, metadata=meta)
    if seen != set(tensors):
        raise ValueError(f"the export holds no weights of {sorted(set(tensors) - seen)[:3]}")
    if weight_map is not None:
        data = json.load(open(index))
        data["weight_map"] = dict(sorted(weight_map.items()))
        with open(index, "w") as fh:
            json.dump(data, fh, indent=2)
    ignore = [n for n in linears if n not in tensors]
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = quantization_config(fmt, ignore)
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh, indent=2)
    return {"format": fmt, "export": "compressed-tensors", "compressed_tensors_format": SCHEMES[fmt]["format"],
            "quantized_linears": len(tensors), "unquantized": dict(sorted(dense.items())),
            "ignore": sorted(ignore)}
