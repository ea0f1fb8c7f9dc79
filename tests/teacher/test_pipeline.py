"""A pipelined Megatron-Core GPT teacher (gloo, 4 ranks): PP=2 and TP=2 x PP=2 builds give the caches of the same
weights at PP=1 (same top-K ids and log-probs, in fact the same bytes), and the teacher's identity does not depend
on the layout. The PP=1 cache is checked against topk(log_softmax(dense logits)) too."""
import os

import numpy as np
import pytest
import torch

from dist_utils import run_ranks
from test_megatron_teacher import _files

V, V_PADDED, S, N, K, LAYERS = 61, 64, 12, 5, 6, 4


def tiny_gpt(tp: int = 1, pp: int = 1):
    """This rank's stage of a 4-layer GPT (rotary positions, untied output layer) at TP=tp, PP=pp."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron_kd.runtime.cpu_patches import apply_cpu_patches, seed_model_parallel_rng
    apply_cpu_patches()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    seed_model_parallel_rng(1234)
    torch.manual_seed(1234)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
                            pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, init_method_std=0.5)
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=V_PADDED, max_sequence_length=S,
                    parallel_output=True, share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())


def global_state(model) -> dict:
    """This rank's weights keyed by their names in the whole (PP=1) model."""
    from megatron_kd.teacher.pipeline import global_layer_names
    names = global_layer_names(model)
    return {names[n]: p.detach().clone() for n, p in model.named_parameters()}


def load_global_state(model, state: dict) -> None:
    from megatron_kd.teacher.pipeline import global_layer_names
    names = global_layer_names(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state[names[n]])


def tokens_dataset():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, V, (N, S + 1), generator=g)


def _build(model, out_dir, **kw):
    from cache_options import encoding_kw
    from megatron.core import parallel_state
    from megatron_kd.teacher.build import build_cache
    from megatron_kd.teacher.megatron import MegatronTeacher
    teacher = MegatronTeacher(model, V, name="tiny-gpt", tp_group=parallel_state.get_tensor_model_parallel_group())
    ident = teacher.identity()
    build_cache(teacher, tokens_dataset(), out_dir, samples_per_shard=2, progress=False,
                **encoding_kw({"top_k": K, **kw}))
    return teacher, ident


def _layouts(rank, world, out_root):
    from megatron.core import parallel_state
    data = tokens_dataset()

    # TP=1, PP=1 (DP=4): the reference weights and cache, and the dense log-probs.
    model = tiny_gpt(tp=1, pp=1)
    state1 = global_state(model)
    _, ident = _build(model, os.path.join(out_root, "pp1"))
    if rank == 0:
        with torch.no_grad():
            logits = model(data[:, :-1], torch.arange(S)[None].expand(N, S),
                           torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None])
        torch.save(torch.log_softmax(logits[..., :V].double(), -1), os.path.join(out_root, "dense.pt"))
    parallel_state.destroy_model_parallel()

    # TP=1, PP=2 (DP=2): two layers per stage; the first stage's ranks send, the last stage's ranks write.
    model = tiny_gpt(tp=1, pp=2)
    load_global_state(model, state1)
    teacher, ident_pp2 = _build(model, os.path.join(out_root, "pp2"))
    assert teacher.is_last_stage == parallel_state.is_pipeline_last_stage()
    assert ident_pp2 == ident, "the teacher's identity must not depend on its pipeline layout"
    parallel_state.destroy_model_parallel()

    # TP=2, PP=1 (DP=2), then TP=2 x PP=2 with the same TP shards.
    model = tiny_gpt(tp=2, pp=1)
    state2 = global_state(model)
    _, ident_tp2 = _build(model, os.path.join(out_root, "tp2"), micro_batch_size=2)
    assert ident_tp2 == ident
    parallel_state.destroy_model_parallel()

    model = tiny_gpt(tp=2, pp=2)
    load_global_state(model, state2)
    _, ident_tp2pp2 = _build(model, os.path.join(out_root, "tp2pp2"), micro_batch_size=2)
    assert ident_tp2pp2 == ident
    parallel_state.destroy_model_parallel()


def _read_all(path):
    from megatron_kd.cache import CacheReader
    r = CacheReader(path)
    return (np.stack([r[i]["topk_ids"] for i in range(len(r))]),
            np.stack([r[i]["topk_logprobs"] for i in range(len(r))]))


@pytest.mark.slow
def test_pipeline_teacher_pp2_tp2pp2(tmp_path):
    run_ranks(4, _layouts, str(tmp_path))
    ids1, lp1 = _read_all(tmp_path / "pp1")
    want_lp, want_ids = torch.load(tmp_path / "dense.pt").topk(K, dim=-1)
    np.testing.assert_array_equal(ids1, want_ids.numpy())
    np.testing.assert_allclose(lp1, want_lp.numpy(), rtol=1e-3, atol=1e-4)
    assert np.exp(lp1[..., 0]).max() > 0.5  # peaked positions: the top-K order matters

    for pp, ref in (("pp2", "pp1"), ("tp2pp2", "tp2")):
        ids, lp = _read_all(tmp_path / pp)
        ids_ref, lp_ref = _read_all(tmp_path / ref)
        np.testing.assert_array_equal(ids, ids_ref)
        np.testing.assert_allclose(lp, lp_ref, rtol=1e-6, atol=1e-6)
        # The last stage sees the PP=1 model's hidden states bit for bit: the same cache, byte for byte.
        assert _files(tmp_path / pp) == _files(tmp_path / ref), f"{pp} and {ref} caches differ"
    # TP=2 vs TP=1 (different rounding): same ids, log-probs at most one fp16 step apart.
    ids2, lp2 = _read_all(tmp_path / "tp2pp2")
    np.testing.assert_array_equal(ids2, ids1)
    assert (np.abs(lp2 - lp1) <= np.spacing(np.abs(lp1).astype(np.float16)).astype(np.float32)).all()


def make_teacher(tp: int = 1, pp: int = 1):
    """CLI factory: `torchrun --nproc_per_node 4 -m megatron_kd cache build --teacher test_pipeline:make_teacher
    --teacher-args '{"tp": 2, "pp": 2}' ...` (random weights; a real factory loads a checkpoint into its stage)."""
    from megatron.core import parallel_state
    from megatron_kd.teacher.megatron import MegatronTeacher
    model = tiny_gpt(tp, pp)
    return MegatronTeacher(model, V, name="tiny-gpt", tp_group=parallel_state.get_tensor_model_parallel_group())
