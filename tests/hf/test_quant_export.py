"""A student trained quantized (quant.format) exports, by default, as a compressed-tensors checkpoint: a quantized
Hugging Face format (low-precision weights, their scales, static input scales) that transformers loads through
the compressed-tensors package, on a CPU, with the trained fake-quantized student's logits, its activation
quantization included. `--quantized folded` still writes the plain checkpoint of its weights on the grid.
`megatron-kd export`, called in-process, against real transformers and compressed-tensors.

Tolerance, per token position: its logits within 1e-5 of the largest logit (fp32), at 98% of the positions at
least. The export holds the student's own codes and steps, so what can differ is fp32 rounding: compressed-tensors
multiplies a code by the stored step (1 / (maxbound / amax)) where ModelOpt divides by maxbound / amax (one ulp on
a weight), and transformers' attention rounds otherwise than Megatron's (about 1e-7). Where that noise puts an
activation on the other side of a rounding boundary of its input quantizer, the activation moves by one
quantization step and that token's logits with it: such positions are the ones allowed to differ (rare: the noise
is a millionth of a step). The quantization itself, and the activation quantization alone, move every position by
orders of magnitude more than the tolerance, which the checks below assert (benchmarks/qad_hf_export.py measures)."""
import json
import os
import shutil

import pytest
import torch

import bridge_env_check  # noqa: F401

pytestmark = [pytest.mark.bridge, pytest.mark.slow]
pytest.importorskip("modelopt.torch.quantization")

V, SEQ = 256, 32
TOL = 1e-5    # of the largest logit, per position
AGREE = 0.98  # of the positions within TOL


def agreement(a, b, scale):
    """(fraction of token positions whose logits agree within TOL * scale, largest difference / scale)."""
    per = (a - b).abs().amax(-1) / scale
    return (per <= TOL).float().mean().item(), per.max().item()


def student_logits(checkpoint, tokens):
    """megatron-kd's evaluation logits of the trained quantized student (its quantizers rebuilt from the
    checkpoint), with its activation quantizers off, and with every quantizer off (its weights off the grid)."""
    from megatron_kd.models import quant
    from test_user_path import logits_of, trained_student
    with trained_student(checkpoint) as m:
        assert quant.is_quantized(m)
        out = {"fake_quant": logits_of(m, tokens, V)}
        for n in quant.activation_quantizers(m):
            m.get_submodule(n).disable()
        out["weights_only"] = logits_of(m, tokens, V)
        for n in quant.enabled_quantizers(m):
            m.get_submodule(n).disable()
        out["unquantized"] = logits_of(m, tokens, V)
        return out


def hf_logits(path, tokens):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return hf, hf(tokens).logits.float()[..., :V]


def trained(tmp_path, fmt, kv_heads):
    import tiny
    from test_user_path import _cli, _docs
    student = str(tmp_path / "student_hf")
    tiny.make_hf(student, "llama", layers=2, hidden=128, heads=4, kv_heads=kv_heads, ffn=256, seed=2, vocab_size=V)
    _docs(tmp_path / "docs.jsonl")
    data, run = str(tmp_path / "data/corpus"), str(tmp_path / "run")
    _cli("data", "prepare", "--input", str(tmp_path / "docs.jsonl"), "--output-prefix", data,
         "--tokenizer", os.path.join(student, "tokenizer.json"))
    _cli("train", "--config-name", "tiny_cpu", "data.kind=indexed", "data.vocab_size=null", f"data.path={data}",
         f"data.tokenizer={student}/tokenizer.json", f"data.seq_length={SEQ}", "data.split='90,10,0'", "kd=ce",
         f"model.hf_path={student}", f"quant.format={fmt}", "quant.calib_samples=4", "train.iters=3",
         "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_iters=1", "train.device=cpu",
         f"train.save={run}", "train.progress=false", "train.tensorboard=false", "train.lr=1e-3")
    return run


def without_input_scales(src, dst):
    """The same checkpoint with its static input scales taken out (config and tensors)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    f = os.path.join(dst, "model.safetensors")
    save_file({k: v for k, v in load_file(f).items() if not k.endswith("input_scale")}, f, metadata={"format": "pt"})
    return dst


# (format, key/value heads of the 4 query heads): int4_awq twice, as AWQ's o_proj scale folds into V's rows only
# when the query heads of a group share it (kv_heads=4: one head a group); with 2 a group it is written unquantized
@pytest.mark.parametrize("fmt,kv_heads", [("fp8", 2), ("int8", 2), ("int8_wo", 2), ("int4_awq", 4), ("int4_awq", 2)])
def test_a_quantized_student_exports_as_compressed_tensors_with_its_logits(tmp_path, fmt, kv_heads, capsys):
    from safetensors.torch import load_file
    from megatron_kd import quant_formats
    from test_user_path import _cli
    static_inputs = quant_formats.get(fmt).export["input_activations"] is not None
    run, out = trained(tmp_path, fmt, kv_heads), str(tmp_path / "student_ct")
    capsys.readouterr()
    _cli("export", "--checkpoint", run, "--out", out)  # a quantized run: compressed-tensors by default
    said = capsys.readouterr().out
    assert f"quantized as {fmt}: a compressed-tensors checkpoint" in said
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    sd = load_file(os.path.join(out, "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    if fmt == "int4_awq":
        assert qc["format"] == "pack-quantized" and sd[f"{q}.weight_packed"].dtype == torch.int32
        assert sd[f"{q}.weight_scale"].shape == (128, 1) and f"{q}.weight" not in sd
        dense = ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"] if kv_heads == 2 else []
        assert qc["ignore"] == sorted(["lm_head", *dense])
        assert all(f"{d}: written unquantized" in said for d in dense)
    else:
        assert sd[f"{q}.weight"].dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
        assert qc["ignore"] == ["lm_head"]
        assert sd[f"{q}.input_scale"].shape == (1,) if static_inputs else f"{q}.input_scale" not in sd
    tokens = torch.randint(0, V, (8, SEQ), generator=torch.Generator().manual_seed(3))
    hf, got = hf_logits(out, tokens)
    assert type(hf.config.quantization_config).__name__ == "CompressedTensorsConfig"
    mine = student_logits(run, tokens)
    scale = mine["fake_quant"].abs().max().item()
    agree = {k: agreement(got, v, scale) for k, v in mine.items()}
    print(f"{fmt} (kv_heads {kv_heads}) compressed-tensors export vs megatron-kd's student (positions within "
          f"{TOL:g} of the largest logit {scale:.3g}; largest difference / it): "
          + ", ".join(f"{k} {a:.3f}, {m:.3g}" for k, (a, m) in agree.items()))
    assert agree["fake_quant"][0] >= AGREE
    assert agree["unquantized"][0] < 0.5, "the quantization grid changes nothing here: the test cannot fail"
    if static_inputs:  # the activation quantization is in the loaded model: without its input scales it is not
        assert agree["weights_only"][0] < 0.5
        _, bare = hf_logits(without_input_scales(out, str(tmp_path / "no_input_scales")), tokens)
        assert agreement(bare, mine["weights_only"], scale)[0] >= AGREE
        assert agreement(bare, mine["fake_quant"], scale)[0] < 0.5


@pytest.mark.parametrize("fmt,how", [("fp8", "folded"), ("w4a8_awq", "auto")])
def test_folded_writes_the_plain_checkpoint_of_the_weights_on_the_grid(tmp_path, capsys, fmt, how):
    """--quantized folded, and auto for a format compressed-tensors does not hold here (w4a8_awq): the weights on
    the grid in a plain checkpoint; transformers gives the student's logits with its activation quantizers off."""
    from test_user_path import _cli
    run, out = trained(tmp_path, fmt, 2), str(tmp_path / "student_folded")
    capsys.readouterr()
    _cli("export", "--checkpoint", run, "--out", out, "--quantized", how)
    said = capsys.readouterr().out
    assert f"quantized as {fmt}: written as its weights on that grid" in said
    assert "activation quantizers (input_quantizer) are not part of it" in said
    assert ("no compressed-tensors export: quant.format=w4a8_awq has no compressed-tensors form" in said) == \
        (how == "auto")
    tokens = torch.randint(0, V, (8, SEQ), generator=torch.Generator().manual_seed(3))
    hf, got = hf_logits(out, tokens)
    assert getattr(hf.config, "quantization_config", None) is None  # a plain checkpoint
    mine = student_logits(run, tokens)
    scale = mine["fake_quant"].abs().max().item()
    assert agreement(got, mine["weights_only"], scale)[0] == 1.0
    assert agreement(got, mine["unquantized"], scale)[0] < 0.5
    assert agreement(got, mine["fake_quant"], scale)[0] < 0.5  # no activation quantization
    if how == "auto":  # asked for, it is refused
        from megatron_kd.cli.main import main
        assert main(["export", "--checkpoint", run, "--out", out, "--overwrite", "--quantized",
                     "compressed-tensors"]) == 2
        assert "quant.format=w4a8_awq has no compressed-tensors form" in capsys.readouterr().err
