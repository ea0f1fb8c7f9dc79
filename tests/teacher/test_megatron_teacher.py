"""A tiny Megatron-Core GPT teacher at TP=1, TP=2 and DP=2 (gloo): cached top-K = topk(log_softmax(dense logits)),
and every layout writes the same cache."""
import os

import numpy as np
import torch

from dist_utils import run_ranks

V, V_PADDED, S, N, K = 61, 64, 12, 5, 6  # 3 padding rows the top-K must never name


def tiny_gpt(tp: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron_kd.runtime.cpu_patches import apply_cpu_patches, seed_model_parallel_rng
    apply_cpu_patches()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    seed_model_parallel_rng(1234)
    torch.manual_seed(1234)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
                            init_method_std=0.5)  # large init: peaked, varied teacher distributions
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=V_PADDED, max_sequence_length=S,
                     parallel_output=True, share_embeddings_and_output_weights=False)
    return model, parallel_state.get_tensor_model_parallel_group()


def tokens_dataset():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, V, (N, S + 1), generator=g)


def _dense_reference(model, data):
    """Full logits through Megatron's own forward, gathered over TP."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    toks = data[:, :-1]
    pos = torch.arange(S)[None].expand(N, S)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        logits = model(toks, pos, mask)  # [b, s, V_padded / tp]
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
    return torch.log_softmax(logits[..., :V].double(), dim=-1)


def _layouts(rank, world, out_root):
    from megatron.core import parallel_state
    from megatron_kd.cache import CacheReader
    from megatron_kd.cache.encoding import EncodingOptions
    from megatron_kd.teacher.build import build_cache
    from megatron_kd.teacher.megatron import MegatronTeacher
    data = tokens_dataset()

    # TP=2: both ranks run the teacher, rank 0 writes.
    model, tp_group = tiny_gpt(tp=2)
    teacher = MegatronTeacher(model, V, name="tiny-gpt", tp_group=tp_group)
    ident_tp2 = teacher.identity()
    build_cache(teacher, data, os.path.join(out_root, "tp2"), encoding=EncodingOptions(top_k=K), samples_per_shard=2, micro_batch_size=2,
                chunk_size=5, progress=False)
    ref_tp2 = _dense_reference(model, data)
    parallel_state.destroy_model_parallel()

    # TP=1, DP=2: each rank computes its own shards (0, 2 on rank 0; 1 on rank 1).
    model, tp_group = tiny_gpt(tp=1)
    teacher = MegatronTeacher(model, V, name="tiny-gpt", tp_group=tp_group)
    assert teacher.identity() == ident_tp2, "the teacher's identity must not depend on its TP layout"
    build_cache(teacher, data, os.path.join(out_root, "dp2"), encoding=EncodingOptions(top_k=K), samples_per_shard=2,
                progress=False)
    ref_tp1 = _dense_reference(model, data)
    parallel_state.destroy_model_parallel()

    if rank == 0:
        torch.save({"ref_tp1": ref_tp1, "ref_tp2": ref_tp2}, os.path.join(out_root, "ref.pt"))


def _single_process(rank, world, out_root):
    from megatron.core import parallel_state
    from megatron_kd.cache.encoding import EncodingOptions
    from megatron_kd.teacher.build import build_cache
    from megatron_kd.teacher.megatron import MegatronTeacher
    model, _ = tiny_gpt(tp=1)
    build_cache(MegatronTeacher(model, V, name="tiny-gpt"), tokens_dataset(), os.path.join(out_root, "tp1"),
                encoding=EncodingOptions(top_k=K), samples_per_shard=2, micro_batch_size=3, progress=False)
    parallel_state.destroy_model_parallel()


def _read_all(path):
    from megatron_kd.cache import CacheReader
    r = CacheReader(path)
    return (np.stack([r[i]["topk_ids"] for i in range(len(r))]),
            np.stack([r[i]["topk_logprobs"] for i in range(len(r))]), r)


def _files(path):
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                out[os.path.relpath(os.path.join(root, n), path)] = f.read()
    return out


def test_megatron_teacher_tp1_tp2_dp2(tmp_path):
    run_ranks(2, _layouts, str(tmp_path))
    run_ranks(1, _single_process, str(tmp_path))
    refs = torch.load(tmp_path / "ref.pt")
    ids_tp2, lp_tp2, r = _read_all(tmp_path / "tp2")
    ids_dp2, lp_dp2, _ = _read_all(tmp_path / "dp2")
    assert r.vocab_size == V and r.top_k == K and len(r) == N and r.seq_length == S

    for ids, lp, ref in ((ids_tp2, lp_tp2, refs["ref_tp2"]), (ids_dp2, lp_dp2, refs["ref_tp1"])):
        want_lp, want_ids = ref.topk(K, dim=-1)
        assert (ids < V).all(), "padding rows of the vocabulary leaked into the top-K"
        np.testing.assert_array_equal(ids, want_ids.numpy())
        # fp16 storage: relative error 2**-11.
        np.testing.assert_allclose(lp, want_lp.numpy(), rtol=1e-3, atol=1e-4)
    # The distributions are varied: some positions are peaked, so the test exercises real top-K ordering.
    assert np.exp(lp_tp2[..., 0]).max() > 0.5

    # TP=1 vs TP=2: the teachers' logits agree to float rounding, so the caches hold the same ids and log-probs.
    # fp16 stores the log-probs, so a rounding difference may flip the last bit: at most one fp16 step apart.
    np.testing.assert_array_equal(ids_tp2, ids_dp2)
    assert (np.abs(lp_tp2 - lp_dp2) <= np.spacing(np.abs(lp_dp2).astype(np.float16)).astype(np.float32)).all()
    # DP=2 vs one process at TP=1: same model, same samples -> byte-identical caches (any micro-batch size).
    assert _files(tmp_path / "dp2") == _files(tmp_path / "tp1")


def make_teacher(tp: int = 1):
    """CLI factory: `megatron-kd cache build --teacher test_megatron_teacher:make_teacher --teacher-args '{"tp": 2}'`
    (run under torchrun with tp processes)."""
    from megatron_kd.teacher.megatron import MegatronTeacher
    model, group = tiny_gpt(tp)
    return MegatronTeacher(model, V, name="tiny-gpt", tp_group=group)
