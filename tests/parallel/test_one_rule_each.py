"""Each shared rule has one definition, here in parallel/limits.py: changing it changes every place that applies it.
The softmax temperature range (loss options, recipe kd section, the teacher's top-K, cache manifests) and the
logits per chunk (torch loss impls, the teacher's top-K, cache builds, the planner)."""
import pytest
import torch

from megatron_kd.cache.checks import manifest_problems
from megatron_kd.cache.format import SETTINGS_KEYS
from megatron_kd.loss.chunks import default_chunk_size
from megatron_kd.loss.options import LossOptions
from megatron_kd.parallel import limits as rules, topk as topk_ops
from megatron_kd.plan import memory

from megatron_kd.parallel.topk import topk_from_hidden, vocab_parallel_topk
from megatron_kd.recipe.compose import compose
from megatron_kd.recipe.checks import check_recipe
from megatron_kd.recipe.schema import RecipeError, to_recipe


def test_the_temperature_range_is_defined_once(monkeypatch):
    LossOptions(temperature=3.0)
    monkeypatch.setattr(rules, "TEMPERATURE_RANGE", (0.5, 2.0))
    with pytest.raises(ValueError, match=r"temperature=3.0 must be a finite number in \[0.5, 2\]"):
        LossOptions(temperature=3.0)
    with pytest.raises(ValueError, match=r"cache_temperature=3.0 must be"):
        LossOptions(cache_temperature=3.0)
    with pytest.raises(ValueError, match=r"temperature=3.0 must be"):
        vocab_parallel_topk(torch.randn(2, 8), 2, temperature=3.0)
    r = to_recipe(compose("tiny_cpu", ["data=mock", "data.vocab_size=64", "kd.temperature=3.0", "kd.cache=/nowhere"]))
    with pytest.raises(RecipeError, match=r"kd.temperature=3.0 must be"):
        check_recipe(r, None, False)
    m = {k: 1 for k in SETTINGS_KEYS + ("shards", "sample_index", "settings_hash")}
    m["temperature"] = 3.0
    assert any("field temperature = 3.0 must be a finite number in [0.5, 2]" in p
               for p in manifest_problems("/nowhere", m, first_only=True))


def test_the_logits_per_chunk_are_defined_once(monkeypatch):
    v = 1000
    before = default_chunk_size(v)
    monkeypatch.setattr(rules, "LOGITS_PER_CHUNK", 64 * v)
    assert default_chunk_size(v) == 64 < before
    calls = []
    real = topk_ops._chunk

    def spy(logits, *a, **k):
        calls.append(logits.shape[0])
        return real(logits, *a, **k)

    monkeypatch.setattr(topk_ops, "_chunk", spy)
    topk_from_hidden(torch.randn(150, 4), torch.randn(v, 4), 3)
    assert calls == [64, 64, 22]
    monkeypatch.undo()
    assert memory.LOGITS_PER_CHUNK is rules.LOGITS_PER_CHUNK  # the planner counts the same chunk (imported)
