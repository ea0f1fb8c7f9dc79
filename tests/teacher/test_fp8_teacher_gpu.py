"""On a GPU with Transformer Engine: the cache build's teacher under teacher.fp8 runs TE's FP8 and its cache says so.

- a teacher of the recipe with teacher.fp8=hybrid (tensorwise) builds a cache whose manifest records backend te+fp8
  and fp8 'hybrid/tensorwise'; the bf16 teacher of the same weights records neither, so the two caches are told
  apart (a build into the other's directory is refused, naming the teacher);
- FP8 changes the numbers (the caches differ) but not the ids much: most of the top-8 agree.
"""
import pytest
import torch

from megatron_kd.runtime import features

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not features.te_available(),
                                 reason="needs CUDA and Transformer Engine")]

SHAPE = ["data=mock", "data.vocab_size=4096", "data.seq_length=512", "teacher.num_layers=2",
         "teacher.hidden_size=512", "teacher.ffn_hidden_size=1024", "teacher.num_attention_heads=8",
         "teacher.num_query_groups=4", "teacher.kv_channels=64", "teacher.attention_backend=te", "kd.cache=/dev/null"]


def _build(tmp_path, name, extra):
    import subprocess
    import sys
    code = f"""
import sys, json, numpy as np, torch
from megatron_kd.recipe.compose import compose
from megatron_kd.recipe.schema import to_recipe
from megatron_kd.teacher.megatron import start_cache_teacher
from megatron_kd.cache.encoding import EncodingOptions
from megatron_kd.teacher.build import build_cache
r = to_recipe(compose("llama31_8b_to_3b_32k_1xh200", {SHAPE + extra!r}, save="/dev/null"))
t = start_cache_teacher(r, r.data.vocab_size)
data = torch.from_numpy(np.random.default_rng(0).integers(0, 4096, size=(2, 513)))
try:
    m = build_cache(t, data, sys.argv[1], encoding=EncodingOptions("fp32", 8), progress=False)
    print(json.dumps(m["teacher"]))
except Exception as e:
    print(json.dumps({{"error": str(e)}}))
"""
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / name)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    import json
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_fp8_teacher_records_its_precision(tmp_path):
    from megatron_kd.cache.reader import CacheReader, teacher_precision
    bf16 = _build(tmp_path, "bf16", [])
    fp8 = _build(tmp_path, "fp8", ["teacher.fp8=hybrid", "teacher.fp8_recipe=tensorwise"])
    assert bf16["backend"] == "te" and "fp8" not in bf16
    assert fp8["backend"] == "te+fp8" and fp8["fp8"] == "hybrid/tensorwise"
    assert bf16["weights_hash"] == fp8["weights_hash"]  # one seed: the same weights
    assert teacher_precision(bf16) == "bf16" and teacher_precision(fp8) == "fp8 (hybrid/tensorwise)"
    a, b = CacheReader(tmp_path / "bf16"), CacheReader(tmp_path / "fp8")
    x, y = a.read(0), b.read(0)
    assert not (x["topk_logprobs"] == y["topk_logprobs"]).all()  # FP8 ran: other numbers
    top1 = (x["topk_ids"][:, 0] == y["topk_ids"][:, 0]).mean()
    assert top1 > 0.1, top1  # chance: 1 in 4096
    # the FP8 teacher into the bf16 teacher's finished cache: refused, not mixed
    again = _build(tmp_path, "bf16", ["teacher.fp8=hybrid", "teacher.fp8_recipe=tensorwise"])
    assert "error" in again and "teacher" in again["error"], again
