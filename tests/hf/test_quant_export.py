"""A student trained quantized (quant.format) exports as a checkpoint transformers loads on a CPU, with the
trained fake-quantized student's logits: exactly (fp32, 1e-5) for a weight-only format (int4_awq); for fp8 the
export holds the weights on fp8's grid and transformers gives the student's logits with its activation quantizers
off (1e-5), the activation quantization itself measured apart (printed). `megatron-kd export`, called in-process."""
import os

import pytest
import torch

import bridge_env_check  # noqa: F401

pytestmark = [pytest.mark.bridge, pytest.mark.slow]
pytest.importorskip("modelopt.torch.quantization")

V, SEQ = 256, 32


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


@pytest.mark.parametrize("fmt", ["int4_awq", "fp8"])
def test_a_quantized_student_exports_to_transformers_with_its_logits(tmp_path, fmt, capsys):
    import tiny
    from test_user_path import _cli, _docs
    student = str(tmp_path / "student_hf")
    tiny.make_hf(student, "llama", layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, seed=2, vocab_size=V)
    _docs(tmp_path / "docs.jsonl")
    data, run, out = (str(tmp_path / x) for x in ("data/corpus", "run", "student_hf_q"))
    _cli("data", "prepare", "--input", str(tmp_path / "docs.jsonl"), "--output-prefix", data,
         "--tokenizer", os.path.join(student, "tokenizer.json"))
    _cli("train", "--config-name", "tiny_cpu", "data.kind=indexed", "data.vocab_size=null", f"data.path={data}",
         f"data.tokenizer={student}/tokenizer.json", f"data.seq_length={SEQ}", "data.split='90,10,0'", "kd=ce",
         f"model.hf_path={student}", f"quant.format={fmt}", "quant.calib_samples=4", "train.iters=3",
         "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_iters=1", "train.device=cpu",
         f"train.save={run}", "train.progress=false", "train.tensorboard=false", "train.lr=1e-3")
    capsys.readouterr()
    _cli("export", "--checkpoint", run, "--out", out)
    said = capsys.readouterr().out
    assert f"quantized as {fmt}: written as its weights on that grid" in said
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert getattr(hf.config, "quantization_config", None) is None  # a plain checkpoint: no quantizer to ignore it
    tokens = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = hf(tokens).logits.float()[..., :V]
    mine = student_logits(run, tokens)
    scale = mine["fake_quant"].abs().max().item()
    err = {k: (got - v).abs().max().item() for k, v in mine.items()}
    print(f"{fmt} export: max |transformers - megatron-kd| logits (logits up to {scale:.3g}): " +
          ", ".join(f"{k} {v:.3g}" for k, v in err.items()))
    assert err["unquantized"] > 1e-3 * scale, "the quantization grid changes nothing here: the test cannot fail"
    assert err["weights_only"] <= 1e-5
    if fmt == "int4_awq":  # weight-only: the trained fake-quantized student itself
        assert "not part of it" not in said and err["fake_quant"] <= 1e-5
    else:
        assert "activation quantizers (input_quantizer) are not part of it" in said
