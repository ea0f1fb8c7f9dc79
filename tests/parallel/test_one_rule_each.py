"""Each shared rule has one definition: changing it changes every place that applies it. In megatron_kd/rules.py
the softmax temperature range (loss options, recipe kd section, the teacher's top-K, cache manifests and builds);
in parallel/limits.py the logits per chunk (torch loss impls, the teacher's top-K, cache builds, the planner)."""
import pytest
import torch

from megatron_kd.cache.checks import manifest_problems
from megatron_kd.cache.format import SETTINGS_KEYS
from megatron_kd.loss.chunks import default_chunk_size
from megatron_kd.loss.options import LossOptions
from megatron_kd import rules
from megatron_kd.cache.encoding import EncodingOptions
from megatron_kd.cache.errors import CacheError
from megatron_kd.cache.format import make_settings
from megatron_kd.parallel import limits, topk as topk_ops
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
    with pytest.raises(CacheError, match=r"temperature=3.0: the capture temperature must be a finite number in "
                                         r"\[0.5, 2\]"):
        make_settings(encoding=EncodingOptions("fp16", 2), vocab_size=8, temperature=3.0, seq_length=4, num_samples=1,
                      teacher={})


def test_the_logits_per_chunk_are_defined_once(monkeypatch):
    v = 1000
    before = default_chunk_size(v)
    monkeypatch.setattr(limits, "LOGITS_PER_CHUNK", 64 * v)
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
    assert memory.LOGITS_PER_CHUNK is limits.LOGITS_PER_CHUNK  # the planner counts the same chunk (imported)


def _reader(vocab_size, top_k=8, temperature=1.0, seq_length=16):
    from types import SimpleNamespace
    return SimpleNamespace(vocab_size=vocab_size, top_k=top_k, temperature=temperature, seq_length=seq_length,
                           path="/c")


def test_one_vocabulary_rule_for_the_cache_and_the_student():
    """The cache records the teacher's tokenizer ids. Against the student's tokenizer vocabulary they must be equal:
    a smaller one is another tokenizer (a 32,000-id cache for a 128,256-id student: every id names another token),
    which `cache <= student` let through. Against a count of embedding rows (a Bridge model config: Qwen2.5 has
    151,936 rows for 151,665 tokens) only `cache <= rows` can be asked."""
    from megatron_kd.bridge.api import check_cache_against_model
    from megatron_kd.bridge.config import OfflineKDConfig
    from megatron_kd.cache.reader import CacheReader
    native = CacheReader.check_compatible
    native(_reader(128256), vocab_size=128256)
    for student in (128256 + 1, 128256 - 1):
        with pytest.raises(CacheError, match="vocabulary: the teacher's is"):
            native(_reader(32000 if student > 32000 else 128256), vocab_size=student)
    with pytest.raises(CacheError, match="vocabulary: the teacher's is 32000 ids, the student's is 128256"):
        native(_reader(32000), vocab_size=128256)
    kd = OfflineKDConfig(cache="/c")
    bridge_reader = _reader(151665)
    bridge_reader.check_compatible = lambda **kw: None
    check_cache_against_model(bridge_reader, kd, vocab_size=151936)  # padded rows past the tokenizer: served
    check_cache_against_model(bridge_reader, kd, vocab_size=151665)
    with pytest.raises(ValueError, match=r"the teacher's vocabulary \(151665\) is larger than the student's"):
        check_cache_against_model(bridge_reader, kd, vocab_size=151000)


def test_one_temperature_equality(monkeypatch):
    """A cache serves a run at its capture temperature, within rules.TEMPERATURE_RTOL (YAML spells floats
    several ways); the rule is read where the reader compares."""
    from megatron_kd.cache.reader import CacheReader
    CacheReader.check_compatible(_reader(64, temperature=0.7), temperature=0.7 * (1 + 1e-7))
    with pytest.raises(CacheError, match="temperature: the cache was captured at T=0.7"):
        CacheReader.check_compatible(_reader(64, temperature=0.7), temperature=0.7 * (1 + 1e-5))
    monkeypatch.setattr(rules, "TEMPERATURE_RTOL", 1e-4)
    CacheReader.check_compatible(_reader(64, temperature=0.7), temperature=0.7 * (1 + 1e-5))


def test_the_default_k_and_encoding_are_defined_once(monkeypatch):
    from megatron_kd.cli import cache as cli_cache
    # None stands for rules.DEFAULT_TOP_K, so that a top_k given beside samples (a sampled cache's K is its number
    # of draws) is told apart from the default
    assert EncodingOptions().top_k is None
    args = cli_cache.parser().parse_args(["build", "--teacher", "t", "--out", "x"])
    assert args.top_k is None and cli_cache._top_k_arg(args, EncodingOptions("fp16")) == rules.DEFAULT_TOP_K
    assert cli_cache._encoding_args(cli_cache.parser().parse_args(["build", "--teacher", "t", "--out", "x",
                                                                   "--samples", "8"])) == \
        EncodingOptions.of("sampled", samples=8)
    assert memory.Training().topk == rules.DEFAULT_TOP_K
    args = cli_cache.parser().parse_args(["build", "--teacher", "t", "--out", "x"])
    assert cli_cache._encoding_args(args) == EncodingOptions("fp16")
    monkeypatch.setattr(rules, "DEFAULT_ENCODING", "compact")
    assert cli_cache._encoding_args(args) == EncodingOptions("compact")
    args = cli_cache.parser().parse_args(["build", "--teacher", "t", "--out", "x", "--top-p", "0.9"])
    assert cli_cache._encoding_args(args) == EncodingOptions.of("topp", top_p=0.9)


def test_padding_hashing_and_free_space_have_one_home():
    from megatron_kd.cache import hashing, space
    from megatron_kd.checkpoint import integrity
    from megatron_kd.models import builder
    from megatron_kd.plan import memory as plan_memory, shapes
    from megatron_kd.recipe import checks
    from megatron_kd.training import safety
    for user in (checks, builder, shapes, plan_memory):
        assert user.padded_vocab_size is rules.padded_vocab_size
    assert rules.padded_vocab_size(201088, 128, 2) == 201216 and rules.padded_vocab_size(50, 1, 1) == 50
    assert integrity.file_sha256 is rules.file_sha256 and hashing.rules is rules
    assert space.free_space is rules.free_space and safety.free_space is rules.free_space


def test_the_kl_scale_and_re_tempering_follow_the_rules(monkeypatch):
    """T^2 x kl_weight is derived once (the loss's options); a cache captured at a temperature equal under
    rules.same_temperature is not re-tempered."""
    opts = LossOptions(temperature=2.0, kl_weight=0.5)
    assert opts.kl_scale == 2.0
    assert LossOptions(temperature=0.7, cache_temperature=0.7 * (1 + 1e-7)).retemper is None
    assert LossOptions(temperature=0.7, cache_temperature=1.4).retemper == 2.0
    monkeypatch.setattr(rules, "TEMPERATURE_RTOL", 0.0)
    assert LossOptions(temperature=0.7, cache_temperature=0.7 * (1 + 1e-7)).retemper is not None


def test_a_sweep_compares_the_cache_temperature_by_the_one_equality(tmp_path, monkeypatch):
    """kd.build_cache=true meeting the sweep's finished cache: a temperature within rules.TEMPERATURE_RTOL is the
    cache's own (as the reader takes it), a farther one would rebuild it and is refused."""
    from megatron_kd.cache import format as cache_format, reader as cache_reader
    r = to_recipe(compose("tiny_cpu", ["data=mock", "data.vocab_size=64", "kd.build_cache=true",
                                       f"kd.cache={tmp_path / 'c'}", f"train.save={tmp_path / 'run'}",
                                       "kd.temperature=0.7"]))
    m = {"top_k": r.kd.top_k, "encoding": r.kd.cache_encoding, "seq_length": r.data.seq_length,
         "num_samples": r.train.iters * r.train.global_batch_size}
    monkeypatch.setattr(cache_format, "is_finished", lambda path: True)
    monkeypatch.setattr(cache_reader, "load_manifest", lambda path: {**m, "temperature": 0.7 * (1 + 1e-7)})
    from megatron_kd.recipe.checks import check_sweep_run
    check_sweep_run(r)
    monkeypatch.setattr(cache_reader, "load_manifest", lambda path: {**m, "temperature": 0.7 * (1 + 1e-4)})
    with pytest.raises(RecipeError, match=r"kd\.temperature=0\.7 \(the cache: 0\.70007"):
        check_sweep_run(r)
