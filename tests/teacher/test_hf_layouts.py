"""Loading under TP=2, PP=2 and EP=2 (gloo, 2 ranks) puts the right shard on each rank, and export gathers them.

Each layout: the model megatron-kd builds from a fresh random HF checkpoint runs (MegatronTeacher; PP through
the cache builder's send/recv stages) and its top-K equals transformers' (ids where the gap exceeds 1e-4,
log-probs to 1e-5); exporting from that layout writes tensors bit-identical to the source (acceptance 2, 0 steps).
"""
import os
from types import SimpleNamespace

import pytest
import torch

import bridge_env_check  # noqa: F401
from dist_utils import run_ranks
from test_hf_teacher_cache import K, check_topk, reference_topk

pytestmark = [pytest.mark.bridge, pytest.mark.slow]

LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "ep2": dict(ep=2, etp=1)}


def _layout(**kw):
    base = dict(tp=1, pp=1, vpp=None, cp=1, ep=1, etp=None, sequence_parallel=False)
    return SimpleNamespace(**{**base, **kw})


def _worker(rank, world, cases):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron_kd.teacher.build import _teacher_topk
    from megatron_kd.teacher.megatron import MegatronTeacher
    from megatron_kd.hf.model import local_layer_spec
    from megatron_kd.hf.model import open_hf
    from megatron_kd.runtime.cpu_patches import apply_cpu_patches, seed_model_parallel_rng
    from megatron_kd.runtime.dist import init_model_parallel
    apply_cpu_patches()
    for name, hf_dir, out in cases:
        p = _layout(**LAYOUTS[name])
        init_model_parallel(p, cuda=False)
        seed_model_parallel_rng(0)
        hf = open_hf(hf_dir, "teacher.hf_path")
        chunks, _ = hf.build(p, layer_spec=local_layer_spec(), seq_length=32)
        shapes = {n: tuple(t.shape) for n, t in chunks[0].named_parameters()}
        if name == "tp2":
            assert shapes["embedding.word_embeddings.weight"][0] == hf.vocab_size // 2, shapes
        if name == "pp2":
            assert ("embedding.word_embeddings.weight" in shapes) == (rank == 0), "embedding on the wrong stage"
            assert ("output_layer.weight" in shapes) == (rank == 1), "output layer on the wrong stage"
        teacher = MegatronTeacher(chunks[0], hf.vocab_size)
        g = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, hf.vocab_size, (2, 32), generator=g)
        ids, lp = _teacher_topk(teacher, tokens, K, 1.0, None, teacher.tp_group)
        teacher.flush()
        if ids is not None:  # the last pipeline stage
            ref = reference_topk(hf_dir, tokens)
            check_topk(ids.reshape(-1, K), lp.reshape(-1, K), ref.reshape(-1, ref.shape[-1]))
        hf.export(chunks, out)
        dist.barrier()
        if rank == 0:
            from safetensors.torch import load_file
            a, b = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
            assert sorted(a) == sorted(b), f"{name}: exported tensor names differ"
            bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
            assert not bad, f"{name}: exported tensors differ from the source: {bad[:5]}"
        ps.destroy_model_parallel()


def test_layouts_load_right_shards_and_export_bit_identical(tmp_path):
    import tiny
    cases = []
    for name in LAYOUTS:
        arch = "gptoss" if name == "ep2" else "llama"
        hf_dir = str(tmp_path / f"hf_{name}")
        tiny.make_hf(hf_dir, arch, layers=4 if name == "pp2" else 2, seed=5)
        cases.append((name, hf_dir, str(tmp_path / f"out_{name}")))
    run_ranks(2, _worker, cases)
