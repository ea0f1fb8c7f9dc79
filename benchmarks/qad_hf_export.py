"""Quantized students exported to Hugging Face: which quantized checkpoint transformers loads on a CPU, and with which
logits. One process, Python 3.12 venv of tests/bridge_env/make_venv.sh (Megatron-Bridge, transformers,
compressed-tensors, ModelOpt), nothing downloaded:

    PYTHONPATH=$PWD $VENV/bin/python benchmarks/qad_hf_export.py --out /tmp/qad_hf_export \\
        --json benchmarks/results/qad_hf_export.json

1. ModelOpt's own Hugging Face export (modelopt.torch.export.export_hf_checkpoint) of a tiny random Llama that
   ModelOpt fake-quantized and calibrated: the files and quantization_config it writes (quant_method "modelopt"),
   and transformers' logits from the folder against the fake-quantized model's; for fp8 also the same folder with
   quant_method "compressed-tensors" (ModelOpt's fp8 tensors are compressed-tensors' float-quantized ones).
2. megatron-kd's export of a student trained quantized (a tiny Llama, 3 steps of kd=ce with quant.format, through
   Megatron-Bridge), as tests/hf/test_quant_export.py makes it: `megatron-kd export` (compressed-tensors, the
   default for a quantized run) and `--quantized folded`, loaded by transformers; their logits against the
   student's own (megatron-kd, fake-quantized / activation quantizers off / unquantized): the largest difference
   over the largest logit, and the token positions within 1e-5 of it; and the compressed-tensors export with its
   input scales taken out.
"""
import argparse
import json
import os
import shutil
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, SEQ = 256, 32


def modelopt_export(fmt: str, out: str) -> dict:
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors.torch import load_file, save_file
    cfgs = {"fp8": mtq.FP8_DEFAULT_CFG, "int8": mtq.INT8_DEFAULT_CFG, "int4_awq": mtq.INT4_AWQ_CFG}
    torch.manual_seed(0)
    c = transformers.LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                 tie_word_embeddings=False)
    c.architectures = ["LlamaForCausalLM"]  # the export reads it
    m = transformers.LlamaForCausalLM(c).eval()
    x = torch.randint(0, V, (2, SEQ))
    mtq.quantize(m, cfgs[fmt], lambda mm: mm(x))
    with torch.no_grad():
        fq = m(x).logits.double()
    d = os.path.join(out, f"modelopt_{fmt}")
    shutil.rmtree(d, ignore_errors=True)
    scale = float(fq.abs().max())
    r = {"format": fmt, "logit_absmax": scale}
    export_hf_checkpoint(m, export_dir=d)  # converts m's weights in place: m is not used after this
    r["files"] = sorted(os.listdir(d))
    r["quantization_config"] = json.load(open(os.path.join(d, "config.json"))).get("quantization_config")
    sd = load_file(os.path.join(d, "model.safetensors"))
    r["q_proj_tensors"] = {k.rsplit(".", 1)[-1]: [str(v.dtype), list(v.shape)] for k, v in sd.items()
                           if ".layers.0.self_attn.q_proj." in k}

    def load(path, key):
        """transformers on the folder: its quantizer (none: it skipped the quantization config) and the largest
        logit difference to the fake-quantized model over the largest logit."""
        try:
            h = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
            with torch.no_grad():
                diff = float((h(x).logits.double() - fq).abs().max()) / scale
            q = getattr(h, "hf_quantizer", None)
            r[key] = {"quantizer": type(q).__name__ if q is not None else None, "max_diff_over_absmax": diff}
        except Exception as e:  # noqa: BLE001 (what transformers does with the folder is the measurement)
            r[key] = f"failed: {type(e).__name__}: {str(e).splitlines()[0]}"[:300]

    load(d, "transformers")
    if fmt == "fp8":  # the same tensors, marked as compressed-tensors' float-quantized format
        d2 = d + "_as_compressed_tensors"
        shutil.rmtree(d2, ignore_errors=True)
        shutil.copytree(d, d2)
        cfg = json.load(open(os.path.join(d2, "config.json")))
        cfg["quantization_config"].update(quant_method="compressed-tensors", format="float-quantized",
                                          quantization_status="compressed")
        json.dump(cfg, open(os.path.join(d2, "config.json"), "w"))
        save_file({k: v.reshape(1) if k.endswith("_scale") and v.dim() == 0 else v for k, v in sd.items()},
                  os.path.join(d2, "model.safetensors"), metadata={"format": "pt"})
        load(d2, "transformers_relabeled_compressed_tensors")
    return r


def megatron_kd_export(fmt: str, kv_heads: int, out: str) -> dict:
    import pathlib
    from test_quant_export import TOL, agreement, hf_logits, student_logits, trained, without_input_scales
    from test_user_path import _cli
    work = pathlib.Path(out) / f"mkd_{fmt}_kv{kv_heads}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run = trained(work, fmt, kv_heads)
    tokens = torch.randint(0, V, (16, SEQ), generator=torch.Generator().manual_seed(3))
    mine = student_logits(run, tokens)
    scale = mine["fake_quant"].abs().max().item()
    r = {"format": fmt, "kv_heads": kv_heads, "query_heads": 4, "positions": tokens.numel(), "logit_absmax": scale}
    for mode in ("compressed-tensors", "folded"):
        d = str(work / mode)
        t0 = time.perf_counter()
        _cli("export", "--checkpoint", run, "--out", d, "--quantized", mode)
        hf, got = hf_logits(d, tokens)
        e = {"seconds": round(time.perf_counter() - t0, 2),
             "quantization_config": json.load(open(os.path.join(d, "config.json"))).get("quantization_config"),
             "bytes": sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))}
        for k, v in mine.items():
            a, m = agreement(got, v, scale)
            e[f"vs_{k}"] = {"positions_within_tol": a, "max_diff_over_absmax": m}
        if mode == "compressed-tensors" and fmt != "int4_awq":
            _, bare = hf_logits(without_input_scales(d, str(work / "no_input_scales")), tokens)
            a, m = agreement(bare, mine["fake_quant"], scale)
            e["without_input_scales_vs_fake_quant"] = {"positions_within_tol": a, "max_diff_over_absmax": m}
        r[mode] = e
    r["tol"] = TOL
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="a scratch directory")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--formats", default="fp8,int8,int4_awq")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "hf")]
    import bridge_env_check  # noqa: F401  (tests/bridge_env shims: Bridge imports without Transformer Engine)
    import compressed_tensors
    import modelopt
    import transformers
    fmts = a.formats.split(",")
    res = {"transformers": transformers.__version__, "compressed_tensors": compressed_tensors.__version__,
           "modelopt": modelopt.__version__, "torch": torch.__version__, "device": "cpu",
           "modelopt_export": [modelopt_export(f, a.out) for f in fmts],
           "megatron_kd_export": [megatron_kd_export(f, kv, a.out) for f in fmts
                                  for kv in ((4, 2) if f == "int4_awq" else (2,))]}
    text = json.dumps(res, indent=2)
    print(text)
    for path in filter(None, (os.path.join(a.out, "qad_hf_export.json"), a.json)):
        with open(path, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
