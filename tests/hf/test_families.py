"""The model-family registry (megatron_kd/families): lookups, and refusals that need no Bridge: an unregistered
model_type, a quantization a family does not read; GPT-OSS's MXFP4 recognised as such."""
import json
import os

import pytest

from megatron_kd import families
from megatron_kd.hf.checks import HFCheckpointError, check_hf_dir, quantization_note


def _ckpt(d, **cfg):
    os.makedirs(d, exist_ok=True)
    json.dump({"architectures": ["XForCausalLM"], **cfg}, open(os.path.join(d, "config.json"), "w"))
    open(os.path.join(d, "model.safetensors"), "wb").close()
    return str(d)


def test_each_registered_module_defines_its_family_once():
    fams = families.all_families()
    assert [f.name for f in fams] == list(families.REGISTERED)
    types = families.model_types()
    assert len(types) == len(set(types)), types
    for f in fams:
        assert families.for_model_type(f.model_types[0], "x") is f and families.get(f.name) is f
    with pytest.raises(KeyError, match="registered: llama, gpt_oss"):
        families.get("opt")


def test_an_unregistered_model_type_is_refused_by_name_listing_the_registered(tmp_path):
    d = _ckpt(tmp_path / "opt", model_type="opt", num_hidden_layers=2)
    with pytest.raises(HFCheckpointError) as e:
        check_hf_dir(d, "teacher.hf_path")
    msg = str(e.value)
    assert "teacher.hf_path=" in msg and "model_type='opt'" in msg and "\n" not in msg
    assert all(t in msg for t in ("llama", "gpt_oss", "qwen2", "qwen3", "qwen3_moe", "mistral")), msg


def test_gpt_oss_mxfp4_is_read_dequantized_and_said_so(tmp_path):
    q = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    d = _ckpt(tmp_path / "oss", model_type="gpt_oss", quantization_config=q)
    check_hf_dir(d, "teacher.hf_path")
    note = quantization_note(d)
    assert "gpt_oss" in note and "mxfp4" in note and "dequantized" in note and "unquantized" in note
    assert quantization_note(_ckpt(tmp_path / "plain", model_type="gpt_oss")) is None


@pytest.mark.parametrize("model_type,method", [("gpt_oss", "fp8"), ("llama", "mxfp4"), ("qwen3", "awq")])
def test_a_quantization_the_family_does_not_read_is_refused(tmp_path, model_type, method):
    d = _ckpt(tmp_path / "q", model_type=model_type, quantization_config={"quant_method": method})
    with pytest.raises(HFCheckpointError) as e:
        check_hf_dir(d, "model.hf_path")
    assert f"quant_method={method!r}" in str(e.value) and "\n" not in str(e.value)
