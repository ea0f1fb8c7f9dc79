"""Llama 3 RoPE scaling at positions past original_max_position_embeddings: a fresh random tiny LlamaForCausalLM
with rope_type llama3 gives transformers' fp32 logits (<= 1e-5) through `model.hf_path` (Megatron-Bridge) and
through megatron-kd's own builder with the same values in the recipe keys (model.rope_scaling*, weights copied
in by Bridge). The same comparison with the scaling switched off (the builder's model.rope_scaling=false, a
config.json with rope_type default) misses by far more, so the test can fail.

The tiny model's RoPE (head dim 16, theta 10^4, original length 32, low 1, high 4) has frequencies in all three
of the formula's regimes (kept, interpolated, stretched); its 128 positions are 4x the original length.
"""
import json
import os
import shutil

import pytest
import torch

import bridge_env_check  # noqa: F401
from dist_utils import run_ranks

pytestmark = pytest.mark.bridge

SEQ, TOL, VOCAB = 128, 1e-5, 256
ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}


def recipe_keys(rope_scaling=True):
    """The recipe's model section for the tiny checkpoint (tests/hf/tiny.py's shape; LlamaConfig's rms_norm_eps)."""
    from megatron_kd.recipe.schema import ModelConfig
    return ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                       kv_channels=16, layernorm_epsilon=1e-6, rotary_base=10000, tie_embeddings=False,
                       attention_backend="sdpa", rope_scaling=rope_scaling, rope_scaling_factor=ROPE["factor"],
                       rope_low_freq_factor=ROPE["low_freq_factor"], rope_high_freq_factor=ROPE["high_freq_factor"],
                       rope_original_max_position_embeddings=ROPE["original_max_position_embeddings"])


def _worker(rank, world, hf_dir, plain_dir, tokens_path, out):
    from megatron.core import parallel_state as ps
    from megatron_kd.hf.model import open_hf
    from megatron_kd.models.builder import build_gpt, build_hf_chunks
    from megatron_kd.recipe.schema import ModelConfig, ParallelConfig
    from megatron_kd.runtime.cpu_patches import apply_cpu_patches, seed_model_parallel_rng
    from megatron_kd.runtime.dist import init_model_parallel
    apply_cpu_patches()
    p = ParallelConfig()
    init_model_parallel(p, cuda=False)
    seed_model_parallel_rng(0)
    tokens = torch.load(tokens_path)
    pos = torch.arange(SEQ).expand_as(tokens)
    models = {
        "hf_path": build_hf_chunks(ModelConfig(hf_path=hf_dir, attention_backend="sdpa"), p, SEQ, "fp32")[0][0],
        "hf_path, config.json rope_type default": build_hf_chunks(
            ModelConfig(hf_path=plain_dir, attention_backend="sdpa"), p, SEQ, "fp32")[0][0],
    }
    for name, on in (("builder", True), ("builder, model.rope_scaling=false", False)):
        m = build_gpt(recipe_keys(on), p, VOCAB, SEQ, "fp32")
        open_hf(hf_dir, "hf_path").load([m])  # the checkpoint's weights, by Bridge's name mapping
        models[name] = m
    logits = {}
    with torch.no_grad():
        for name, m in models.items():
            logits[name] = m.eval()(input_ids=tokens, position_ids=pos, attention_mask=None)[..., :VOCAB].float()
    torch.save(logits, out)
    ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    """{path: max |logit - transformers' logit|} over 2 x 128 positions."""
    import tiny
    root = tmp_path_factory.mktemp("rope_llama3")
    hf_dir, plain_dir = str(root / "llama3"), str(root / "llama3_as_default")
    hf = tiny.make_hf(hf_dir, "llama", seed=3, config={"rope_parameters": dict(ROPE)})
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    shutil.copytree(hf_dir, plain_dir)  # the same weights, config.json without the scaling
    with open(os.path.join(plain_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": ROPE["rope_theta"]}
    with open(os.path.join(plain_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    torch.save(tokens, root / "tokens.pt")
    ref = tiny.hf_logits(hf, tokens)
    run_ranks(1, _worker, hf_dir, plain_dir, str(root / "tokens.pt"), str(root / "logits.pt"))
    got = torch.load(root / "logits.pt")
    errs = {k: (v - ref).abs().max().item() for k, v in got.items()}
    print("max |logit - transformers'| (rope_type llama3, 128 positions, original 32):", errs)
    return errs


@pytest.mark.parametrize("path", ["hf_path", "builder"])
def test_llama3_logits_equal_transformers(errors, path):
    assert errors[path] <= TOL, f"{path}: logits differ from transformers' by {errors[path]:.3g} > {TOL}"


@pytest.mark.parametrize("path", ["hf_path, config.json rope_type default", "builder, model.rope_scaling=false"])
def test_scaling_off_is_told_apart(errors, path):
    assert errors[path] > 1000 * TOL, f"{path}: {errors[path]:.3g}, the test could not tell scaling off from on"
