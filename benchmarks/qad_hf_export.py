"""Does ModelOpt's Hugging Face export of a fake-quantized model load in transformers on a CPU, with the logits of
the model it came from? One tiny random Llama per format (no download), in one process.

    PYTHONPATH=/tmp/qad_site ~/.cache/megatron-kd/venv312-*/bin/python benchmarks/qad_hf_export.py --out DIR

(Python 3.12 with transformers; modelopt from the wheels in .whlq: pip install --no-index --no-deps --target
/tmp/qad_site .whlq/nvidia_modelopt*.whl .whlq/pulp*.whl .whlq/nvidia_ml_py*.whl .whlq/ninja*.whl
.whlq/omegaconf*.whl.) Per format: quantize + calibrate, the fake-quantized logits (and with the activation
quantizers off), modelopt.torch.export.export_hf_checkpoint, then (a) transformers' AutoModelForCausalLM on the
folder and (b) the folder's weights dequantized by hand (weight x weight_scale) into a plain model. Writes
qad_hf_export.json in DIR.
"""
import argparse
import json
import os
import shutil
import sys

import torch


def one(fmt: str, out: str) -> dict:
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors.torch import load_file
    cfgs = {"fp8": mtq.FP8_DEFAULT_CFG, "int8": mtq.INT8_DEFAULT_CFG, "int4_awq": mtq.INT4_AWQ_CFG}
    torch.manual_seed(0)
    c = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                 tie_word_embeddings=False)
    c.architectures = ["LlamaForCausalLM"]  # the export reads it
    m = transformers.LlamaForCausalLM(c).eval()
    x = torch.randint(0, 256, (2, 32))
    mtq.quantize(m, cfgs[fmt], lambda mm: mm(x))
    with torch.no_grad():
        fq = m(x).logits.double()
        mtq.disable_quantizer(m, "*input_quantizer")
        wq = m(x).logits.double()  # weights quantized, activations not
        mtq.enable_quantizer(m, "*input_quantizer")
    d = os.path.join(out, fmt)
    shutil.rmtree(d, ignore_errors=True)
    r = {"format": fmt, "logit_absmax": float(fq.abs().max())}
    try:
        export_hf_checkpoint(m, export_dir=d)  # converts m's weights in place: m is not used after this
    except Exception as e:
        return {**r, "export": f"failed: {type(e).__name__}: {e}"[:300]}
    r["files"] = sorted(os.listdir(d))
    r["quantization_config"] = json.load(open(os.path.join(d, "config.json"))).get("quantization_config")
    try:
        h = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
        with torch.no_grad():
            r["transformers_load_max_abs_diff"] = float((h(x).logits.double() - fq).abs().max())
    except Exception as e:
        r["transformers_load"] = f"failed: {type(e).__name__}: {e}"[:300]
    sd = load_file(os.path.join(d, "model.safetensors"))
    deq = {}
    for k, v in sd.items():
        scale = sd.get(k[:-len(".weight")] + ".weight_scale") if k.endswith(".weight") else None
        if scale is not None:
            if v.dtype == torch.uint8 or scale.dim() == 2:
                r["dequantized"] = f"packed {v.dtype} {tuple(v.shape)} with block scales {tuple(scale.shape)}: not " \
                                   "dequantized here"
                return r
            deq[k] = v.float() * (scale.float() if scale.dim() == 0 else scale.float().view(-1, 1))
        elif not k.endswith("_scale"):
            deq[k] = v.float()
    plain = transformers.LlamaForCausalLM(c).eval()
    plain.load_state_dict(deq, strict=True)
    with torch.no_grad():
        dl = plain(x).logits.double()
    r["dequantized_vs_fake_quant_max_abs_diff"] = float((dl - fq).abs().max())
    r["dequantized_vs_weight_only_fake_quant_max_abs_diff"] = float((dl - wq).abs().max())
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--formats", default="fp8,int8,int4_awq")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import transformers
    import modelopt
    res = {"transformers": transformers.__version__, "modelopt": modelopt.__version__, "torch": torch.__version__,
           "formats": [one(f, args.out) for f in args.formats.split(",")]}
    print(json.dumps(res, indent=1))
    with open(os.path.join(args.out, "qad_hf_export.json"), "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
