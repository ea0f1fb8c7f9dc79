"""Llama 3 RoPE scaling of the recipe builder (model.rope_scaling*, models/builder.py) against a float64 reference of
transformers' llama3 formula, at positions past rope_original_max_position_embeddings; the recipe checks of its
keys; and a resume from a checkpoint made before the keys existed. Runs with megatron-core 0.16.1 (Python 3.11)
and 0.19.2 (Python 3.12). The logits against transformers themselves: tests/hf/test_rope_scaling_hf.py (Bridge)."""
import math

import pytest
import torch

from dist_utils import run_ranks

HEAD_DIM, BASE, SEQ = 16, 10000, 128


def llama3_inv_freq_f64(dim, base, factor, low, high, original):
    """transformers' _compute_llama3_parameters in float64, written out per frequency."""
    out = []
    for i in range(0, dim, 2):
        f = 1.0 / base ** (i / dim)
        wavelen = 2 * math.pi / f
        if wavelen < original / high:          # high frequencies: kept
            out.append(f)
        elif wavelen > original / low:         # low frequencies: stretched by factor
            out.append(f / factor)
        else:                                  # between: interpolated
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def regimes(dim, base, low, high, original):
    wl = [2 * math.pi * base ** (i / dim) for i in range(0, dim, 2)]
    return {"kept": sum(w < original / high for w in wl), "stretched": sum(w > original / low for w in wl),
            "interpolated": sum(original / high <= w <= original / low for w in wl)}


# (factor, low, high, original): megatron-core's own values for the last three (GPTModel's rope_scaling path
# alone), and others (the builder's fix of the built model on top)
CASES = [(8.0, 1.0, 4.0, 32), (32.0, 2.0, 8.0, 64), (8.0, 1.0, 4.0, 8192)]


def _model_config(**kw):
    from megatron_kd.recipe.schema import ModelConfig
    return ModelConfig(num_layers=1, hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_query_groups=2,
                       kv_channels=HEAD_DIM, rotary_base=BASE, attention_backend="sdpa", **kw)


def _worker(rank, world, out):
    from megatron.core import parallel_state as ps
    from megatron_kd.models.builder import build_gpt
    from megatron_kd.recipe.schema import ParallelConfig
    from megatron_kd.runtime.cpu_patches import apply_cpu_patches
    apply_cpu_patches()
    ps.initialize_model_parallel()
    got = {}
    for name, kw in [("plain", {})] + [(c, dict(rope_scaling=True, rope_scaling_factor=c[0], rope_low_freq_factor=c[1],
                                                rope_high_freq_factor=c[2], rope_original_max_position_embeddings=c[3]))
                                       for c in CASES]:
        m = build_gpt(_model_config(**kw), ParallelConfig(), 64, SEQ, "fp32")
        got[name] = m.rotary_pos_emb(SEQ).detach().reshape(SEQ, HEAD_DIM).double()
    ps.destroy_model_parallel()
    torch.save(got, out)


@pytest.fixture(scope="module")
def angles(tmp_path_factory):
    """{case: [SEQ, HEAD_DIM] RoPE angles of a GPTModel the builder made} (one spawned rank for all cases)."""
    out = str(tmp_path_factory.mktemp("rope") / "angles.pt")
    run_ranks(1, _worker, out)
    return torch.load(out)


def reference(case):
    pos = torch.arange(SEQ, dtype=torch.float64)
    a = torch.outer(pos, llama3_inv_freq_f64(HEAD_DIM, BASE, *case))
    return torch.cat([a, a], -1)  # megatron-core's layout: first half even components, second half odd


@pytest.mark.parametrize("case", CASES, ids=lambda c: "factor{}_low{}_high{}_orig{}".format(*c))
def test_builder_rope_angles_match_float64_llama3(angles, case):
    got, ref = angles[case], reference(case)
    if case[3] < SEQ:  # the case is meaningful: positions past the original length, every regime present
        assert all(regimes(HEAD_DIM, BASE, *case[1:]).values()), regimes(HEAD_DIM, BASE, *case[1:])
    # fp32 inverse frequencies times positions < 128: relative error a few fp32 ulps
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    # the same check tells scaling off from on: plain RoPE's angles miss the reference by 10^4 x the tolerance
    assert (angles["plain"] - ref).abs().max() > 1e-2


def test_rope_scaling_keys_are_checked():
    from megatron_kd.recipe.checks import check_model
    from megatron_kd.recipe.schema import RecipeError
    check_model(_model_config(rope_scaling=True, rope_scaling_factor=32.0), "model", 1)
    for bad, match in ((dict(rope_scaling_factor=32.0), "model.rope_scaling_factor=32.0 has no effect with "
                                                         "model.rope_scaling=false; set model.rope_scaling=true .*"
                                                         "override '~model.rope_scaling_factor'"),
                       (dict(rope_scaling=True, rope_scaling_factor=0.5), "rope_scaling_factor=0.5 must be >= 1"),
                       (dict(rope_scaling=True, rope_low_freq_factor=4.0, rope_high_freq_factor=4.0),
                        "need 0 < low < high"),
                       (dict(rope_scaling=True, rope_original_max_position_embeddings=0), "positive integer"),
                       (dict(rope_scaling=True, position_embedding_type="learned_absolute"), "set it to rope")):
        with pytest.raises(RecipeError, match=match):
            check_model(_model_config(**bad), "model", 1)


def test_resume_from_a_checkpoint_made_before_the_keys_is_compared_at_plain_rope():
    """A checkpoint's recipe without the rope_* keys was plain RoPE: resuming it with Llama 3 scaling on is an
    architecture change (refused), resuming it with scaling off is not."""
    import dataclasses
    from megatron_kd.recipe.schema import Recipe
    from megatron_kd.training.resume import resume_differences
    from megatron_kd.recipe.checks import ROPE_SCALING_KEYS
    r = Recipe()
    old = dataclasses.asdict(r)
    for k in ("rope_scaling", *ROPE_SCALING_KEYS):
        del old["model"][k]
    assert resume_differences(old, r) == []
    r.model.rope_scaling = True
    assert ("model.rope_scaling", False, True) in resume_differences(old, r)
