"""The cache megatron-kd builds from teacher.hf_path equals transformers' top-K.

Fresh random tiny Llama (GQA, tied and untied embeddings) and GPT-OSS (sinks, sliding window, MoE, YaRN)
checkpoints; the teacher is built through Megatron-Bridge at TP=1 and TP=2 on gloo with the default attention
backend (GPT-OSS at TP=2 on it crashed once: its sinks were marked as TP shards twice). The fp32 top-K the builder
encodes must match transformers' forward (ids wherever the logit gap exceeds 1e-4, log-probs to 1e-5); the cache
on disk must hold the same ids and those log-probs rounded to its fp16 encoding.
"""
import os

import numpy as np
import pytest
import torch

import bridge_env_check  # noqa: F401  (test-only Bridge shims, when Bridge is installed)
from dist_utils import run_ranks

pytestmark = [pytest.mark.bridge, pytest.mark.slow]

SEQ, K, SAMPLES = 32, 8, 4


def teacher_overrides(hf_dir, cache, tp, vocab=256):
    # the default attention backend (auto: SDPA / FlexAttention without TE), GPT-OSS included
    return ["kd=offline", f"kd.cache={cache}", "kd.build_cache=true", f"kd.top_k={K}", f"teacher.hf_path={hf_dir}",
            "data=mock", f"data.vocab_size={vocab}", f"data.seq_length={SEQ}",
            f"parallel.tp={tp}", "train.iters=2", "train.micro_batch_size=2", "train.global_batch_size=2",
            "train.progress=false", "train.device=cpu"]


def reference_topk(hf_dir, tokens, vocab=None):
    """transformers' fp32 log-probs [b, s, V] of the tokens, over the tokenizer's `vocab` ids (an embedding padded
    past them: the padding rows are no token, so no KD target)."""
    import tiny
    logits = tiny.hf_logits(hf_dir, tokens).double()
    return torch.log_softmax(logits[..., :vocab], -1)


def check_topk(ids, lp, ref_lp, k=K, gap=1e-4, tol=1e-5):
    """ids/lp [n, K] against the reference [n, V]: log-probs to tol, ids wherever the neighbours' gap > gap."""
    ref_vals, ref_ids = ref_lp.topk(k + 1, dim=-1)
    lp, ids = torch.as_tensor(lp).double(), torch.as_tensor(ids)
    err = (lp - ref_vals[:, :k]).abs().max().item()
    assert err <= tol, f"log-probs differ from transformers' by {err:.3g} > {tol}"
    gaps = torch.cat([torch.full_like(ref_vals[:, :1], float("inf")), ref_vals[:, :-1] - ref_vals[:, 1:]], 1)
    sure = (gaps[:, :k] > gap) & (gaps[:, 1:k + 1] > gap)
    bad = (ids != ref_ids[:, :k]) & sure
    assert sure.float().mean() > 0.9, "test too weak: most ranks are ties"
    assert not bad.any(), f"{int(bad.sum())} top-K ids differ from transformers' where the gap exceeds {gap}"
    return err


def _worker(rank, world, cases, tp):
    from megatron_kd.cache import CacheReader
    from megatron_kd.teacher.build import _teacher_topk
    from megatron_kd.cache.dataset import split_sample
    from megatron_kd.teacher.factories import recipe_dataset, recipe_teacher
    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import to_recipe
    from megatron_kd.teacher.build import build_cache_only
    for hf_dir, cache, out, vocab in cases:
        ov = teacher_overrides(hf_dir, cache, tp, vocab)
        build_cache_only(to_recipe(compose("tiny_cpu", ov, save=os.path.dirname(cache))))
        ds = recipe_dataset("tiny_cpu", ov)
        teacher = recipe_teacher("tiny_cpu", ov)
        tokens = torch.stack([split_sample(ds[i])["tokens"] for i in range(SAMPLES)])
        ids, lp = _teacher_topk(teacher, tokens, K, 1.0, None, teacher.tp_group)
        if rank == 0:
            ref = reference_topk(hf_dir, tokens, vocab)
            err = check_topk(ids.reshape(-1, K), lp.reshape(-1, K), ref.reshape(-1, ref.shape[-1]))
            reader = CacheReader(cache)
            c_ids = np.stack([reader[i]["topk_ids"] for i in range(SAMPLES)])
            c_lp = np.stack([reader[i]["topk_logprobs"] for i in range(SAMPLES)])
            assert (c_ids == ids.numpy()).all(), f"{hf_dir}: the cache's ids are not the ones the teacher computed"
            fp16 = lp.to(torch.float16).float().numpy()
            assert np.abs(c_lp - fp16).max() == 0.0, f"{hf_dir}: the cache is not the fp16 rounding of the top-K"
            with open(out, "w") as f:
                f.write(f"{err}")
        from megatron.core import parallel_state as ps
        ps.destroy_model_parallel()


# untied / tied GQA Llama; GPT-OSS; a Llama whose embedding has 272 rows for a 250-id tokenizer (Qwen-style padding);
# Qwen3 (GQA 4:1, head_dim 24 != 64 / 8, a window from layer 1), tied Qwen3-MoE (top-2 of 4, head_dim 24, Llama 3
# RoPE scaling), Mistral (window 8, linear RoPE scaling): (arch, tied, (rows, tokenizer ids), config.json fields)
ARCHS = [("llama", False, None, {}), ("llama", True, None, {}), ("gptoss", False, None, {}),
         ("llama", False, (272, 250), {}),
         ("qwen3", False, None, {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 24,
                                 "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
         ("qwen3_moe", True, None, {"head_dim": 24, "rope_parameters": {
             "rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
             "original_max_position_embeddings": 64}}),
         ("mistral", False, None, {"sliding_window": 8, "rope_parameters": {
             "rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}})]


@pytest.mark.parametrize("tp", [1, 2])
def test_cache_from_hf_teacher_equals_transformers(tmp_path, tp):
    """One gloo launch per TP size runs the checkpoints of every family (Bridge imports once per rank)."""
    import tiny
    cases = []
    for arch, tied, padded, config in ARCHS:
        name = f"{arch}_{'tied' if tied else 'untied'}" + ("_padded" if padded else "")
        hf_dir = str(tmp_path / f"hf_{name}")
        rows, tok = padded or (256, 256)
        tiny.make_hf(hf_dir, arch, tied=tied, seed=3, vocab_size=rows, tokenizer_size=tok, config=config)
        cases.append((hf_dir, str(tmp_path / f"run_{name}" / "cache"), str(tmp_path / f"err_{name}.txt"), tok))
    run_ranks(tp, _worker, cases, tp)
    errs = {os.path.basename(c[0]): float(open(c[2]).read()) for c in cases}
    print(f"TP={tp} max |log-prob - transformers'|:", errs)
    assert max(errs.values()) <= 1e-5
