"""The HF path builds the TransformerConfig megatron-kd's own builder builds for the same architecture: Bridge's
provider carries the checkpoint's architecture, every run setting (precision, recompute, dropout, fusions, softmax
precision, ...) is ours. A field that differs would make an HF student train differently from a random-init one
(measured on one H200 at 32K: 391.1 vs 394.3 TFLOP/s, 92.35 vs 92.33 GiB; benchmarks/hf_e2e_bench.py)."""
import dataclasses

import pytest
import torch

import bridge_env_check  # noqa: F401

pytestmark = pytest.mark.bridge


def _same(a, b) -> bool:
    try:
        eq = a == b
        return bool(eq.all()) if torch.is_tensor(eq) else bool(eq)
    except Exception:
        return str(a) == str(b)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_hf_provider_equals_megatron_kd_config(tmp_path, precision):
    import tiny
    from megatron_kd.recipe.hf import resolve
    from megatron_kd.recipe.schema import to_recipe
    from megatron_kd.runtime.dist import distributed
    from megatron_kd.models.builder import build_hf_chunks, transformer_config
    from megatron_kd.recipe.compose import compose
    tiny.make_hf(str(tmp_path / "s"), "llama", layers=2, hidden=64, heads=4, kv_heads=2, tied=True)
    r = to_recipe(compose("llama31_8b_to_3b_32k_1xh200", [
        "data=mock", "data.vocab_size=256", "data.seq_length=64", "train.device=cpu", f"model.hf_path={tmp_path}/s",
        "model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]))
    resolve(r, teacher=False)  # the checkpoint's architecture into r.model
    with distributed(r.parallel, 0, "cpu"):
        ours = transformer_config(r.model, r.parallel, precision)
        _, hf = build_hf_chunks(r.model, r.parallel, 64, precision, load_weights=False)
    diff = {f.name: (getattr(ours, f.name), getattr(hf, f.name, None)) for f in dataclasses.fields(ours)
            if f.name != "transformer_layer_spec" and not callable(getattr(ours, f.name))
            and not _same(getattr(ours, f.name), getattr(hf, f.name, None))}
    assert not diff, f"HF provider vs megatron-kd's TransformerConfig (ours, hf): {diff}"
    assert hf.recompute_granularity == "full" and hf.params_dtype == ours.params_dtype


@pytest.mark.parametrize("arch,want", [("llama", "swiglu"), ("gptoss", "quick_geglu")])
def test_architecture_names_the_gated_mlp(tmp_path, arch, want):
    """The architecture written into the recipe (FLOP counts, resume checks) names the gated MLP: GPT-OSS's
    quick_gelu GLU is quick_geglu (it was read as plain gelu, counting fc1 at half its width)."""
    import tiny
    from megatron_kd.hf.model import HFModel
    tiny.make_hf(str(tmp_path / arch), arch, layers=2, hidden=64, heads=4, kv_heads=2)
    assert HFModel(str(tmp_path / arch)).architecture()["activation"] == want
