"""A tokenizer's identity and "is this a finished cache" have one definition each (cache/hashing.py over
rules.file_sha256, cache/format.py); data loading, corpus preparation, the recipe's HF checks and the CLI use them."""
import json

from megatron_kd.cache import format as cache_format
from megatron_kd import rules
from megatron_kd.cache.format import is_finished
from megatron_kd.cache.hashing import tokenizer_id
from megatron_kd.data.corpus import prepare
from megatron_kd.data.datasets import FileTokenizer


def test_one_tokenizer_identity(tmp_path, monkeypatch):
    out = prepare(["one two three", "four five six seven"] * 20, str(tmp_path / "d"), vocab_size=300)
    tok = out["tokenizer"]
    assert out["tokenizer_sha256"] == tokenizer_id(tok) == FileTokenizer(tok).sha
    monkeypatch.setattr(rules, "file_sha256", lambda path: "f" * 64)  # the one place that hashes a file
    assert FileTokenizer(tok).sha == "f" * 16 == tokenizer_id(tok)


def test_one_finished_cache_rule(tmp_path, monkeypatch):
    assert not is_finished(tmp_path) and not is_finished(None)
    (tmp_path / "manifest.json").write_text(json.dumps({}))
    assert is_finished(tmp_path)
    monkeypatch.setattr(cache_format, "MANIFEST", "other.json")
    assert not is_finished(tmp_path)
    from megatron_kd.recipe.hf import _cache_missing
    assert _cache_missing(str(tmp_path))
